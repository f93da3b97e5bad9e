"""Test set-up: point the data loaders at the offline copies in ../shared/data
(when the project sits beside it, as in CI) and never try to download."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

if "DPFL_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["DPFL_DATA_DIR"] = str(SHARED_DATA)
os.environ.setdefault("DPFL_NO_DOWNLOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
