"""`DPCheckpoint`: a crash-safe end-of-epoch checkpoint of a `DPModel`.

The whole model is saved as ``.keras`` -- weights, the lot counter (a weight),
the optimizer state and the privacy ledger (in the config) -- so the ledger in
a checkpoint always describes exactly the lots applied to the weights in the
same file.  Writes are atomic, in the order the federated server uses:

  1. ``model-<epoch>.keras`` is written to a temporary file beside it, synced,
     and renamed into place;
  2. ``state.json`` (epoch, file name, lots applied, ledger size) is written
     the same way and names the new model file;
  3. older model files are removed.

A process killed at any point leaves ``state.json`` naming a complete model
file: the last finished epoch, or the one before.  Lots the killed process
applied after that checkpoint die with it (their weights were never saved), so
the resumed run neither counts them nor loses any lot of the weights it
continues from.  (If anything computed from those lost lots was published --
say a per-lot loss in a log -- that release is outside the ledger.)

    dp_model.fit(x, y, lot_size=600, epochs=50, callbacks=[DPCheckpoint("ckpt")])
    # ... killed ...
    model, initial_epoch = DPCheckpoint.restore("ckpt")
    model.fit(x, y, lot_size=600, epochs=50, initial_epoch=initial_epoch,
              callbacks=[DPCheckpoint("ckpt")])
"""

from __future__ import annotations

import glob
import os

import keras

from dpfl_tf._io import atomic_path, atomic_write_json, read_checkpoint_json

__all__ = ["DPCheckpoint"]

CHECKPOINT_FORMAT = 1
STATE_FILE = "state.json"


class DPCheckpoint(keras.callbacks.Callback):
    """Saves the `DPModel` (``.keras``) atomically at the end of every epoch.

    Args:
      directory: where ``model-<epoch>.keras`` and ``state.json`` go.
      every: save every `every` epochs, and after the last epoch and the epoch
        in which the budget stopped training (``epoch`` then counts that
        partial epoch as done).
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 1):
        super().__init__()
        from dpfl_tf._validation import check_count

        self.directory = os.fspath(directory)
        self.every = check_count("every", every, minimum=1)

    def on_train_begin(self, logs=None):
        from dpfl_tf.keras.model import DPModel

        if not isinstance(self.model, DPModel):
            raise TypeError(
                f"DPCheckpoint checkpoints a DPModel (its lot counter and ledger), "
                f"got {type(self.model).__name__}"
            )
        if self._chief():
            os.makedirs(self.directory, exist_ok=True)

    def _chief(self) -> bool:
        """Under a MultiWorkerMirroredStrategy only the chief writes the checkpoint."""
        from dpfl_tf.keras.multiworker import is_chief

        return is_chief(self.model.distribute_strategy)

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        last = done == (self.params or {}).get("epochs")
        if done % self.every == 0 or last or self.model.stop_training:
            self.save(done)

    def save(self, epoch: int) -> dict:
        """Writes the checkpoint for `epoch` finished epochs; returns the state.

        Under a MultiWorkerMirroredStrategy every worker must call it (saving
        may read variables collectively), but only the chief writes to
        `directory`: another worker saves into a temporary directory and
        deletes it.  It returns on every worker once the chief's files are
        written."""
        from dpfl_tf.keras.multiworker import barrier, save_model

        name = f"model-{epoch:06d}.keras"
        if not self._chief():
            save_model(self.model, name, overwrite=True)  # a scratch copy, deleted
            return self._state(epoch, name)
        path = os.path.join(self.directory, name)
        with atomic_path(path, suffix=".keras") as tmp:  # Keras wants a .keras name
            self.model.save(tmp, overwrite=True)
        state = self._state(epoch, name)
        atomic_write_json(os.path.join(self.directory, STATE_FILE), state)
        for old in glob.glob(os.path.join(self.directory, "model-*.keras")):
            if os.path.basename(old) != name:
                os.unlink(old)
        barrier(self.model.distribute_strategy)
        return state

    def _state(self, epoch: int, name: str) -> dict:
        ledger = self.model.privacy_ledger
        return {
            "format": CHECKPOINT_FORMAT,
            "epoch": int(epoch),
            "model": name,
            "lots_applied": self.model.lots_applied,
            "ledger_count": ledger.count(),
            "ledger": ledger.entries,
        }

    # -- reading back ------------------------------------------------------------
    @staticmethod
    def latest(directory: str | os.PathLike) -> dict | None:
        """The state of the last complete checkpoint in `directory`, or None."""
        path = os.path.join(os.fspath(directory), STATE_FILE)
        state = read_checkpoint_json(path)
        if state is None:
            return None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not a dpfl_tf DPCheckpoint (format {CHECKPOINT_FORMAT})")
        return state

    @staticmethod
    def restore(directory: str | os.PathLike):
        """(model, initial_epoch) from the last checkpoint; pass `initial_epoch` to
        `fit` to run the remaining epochs.  The model keeps its ledger, lot
        counter and optimizer state.  Raises FileNotFoundError if there is none.

        Under a distribution strategy call it inside ``strategy.scope()``; under
        a MultiWorkerMirroredStrategy on every worker, each reading the chief's
        checkpoint (a shared directory, or a copy of it)."""
        from dpfl_tf.keras.model import DPModel

        state = DPCheckpoint.latest(directory)
        if state is None:
            raise FileNotFoundError(
                f"no DPCheckpoint in {os.fspath(directory)!r} ({STATE_FILE} is missing)"
            )
        path = os.path.join(os.fspath(directory), state["model"])
        try:
            model = keras.saving.load_model(path)
        except Exception as e:  # a truncated or overwritten .keras file
            raise ValueError(
                f"{path} cannot be loaded ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); delete the "
                "checkpoint directory or use another one"
            ) from None
        if not isinstance(model, DPModel):
            raise ValueError(f"{state['model']} does not hold a DPModel")
        if model.lots_applied != state["lots_applied"]:
            raise ValueError(
                f"{state['model']} has {model.lots_applied} lots applied but "
                f"{STATE_FILE} records {state['lots_applied']}: the checkpoint "
                "is inconsistent"
            )
        return model, int(state["epoch"])
