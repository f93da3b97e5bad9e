"""TensorBoard logging of a DP run: Keras's `TensorBoard` callback, with a clear
error when the optional `tensorboard` package is missing.

The `PrivacyCallback` that `DPModel.fit` adds writes ``epsilon`` (and ``lots``)
into the Keras logs, so TensorBoard plots epsilon beside the loss.  Note that
the training loss and metrics are non-private statistics of the training data
(``fit(log_train_metrics=False)`` leaves them out).
"""

from __future__ import annotations

import importlib.util

__all__ = ["tensorboard_callback", "require_tensorboard", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'dpfl-tf[tensorboard]'"


def require_tensorboard(what: str = "TensorBoard logging") -> None:
    """Raises ImportError naming the extra to install when `tensorboard` is absent."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            f"{what} needs the tensorboard package, which is not installed: {INSTALL_HINT}"
        )


def tensorboard_callback(log_dir: str, **kwargs):
    """``keras.callbacks.TensorBoard(log_dir, **kwargs)`` after checking that the
    `tensorboard` package is installed (the `tensorboard` extra)."""
    require_tensorboard()
    import keras

    return keras.callbacks.TensorBoard(log_dir, **kwargs)
