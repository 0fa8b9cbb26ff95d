"""The training proxy: supervision of the engine process (supervision.py) and the run's records
(records.py, which documents the record formats)."""
from .records import LOSS_FORMAT, RecordError, RunRecords, archive_pivot
from .supervision import Supervisor, main, refuse_unusable_checkpoints, supervise

__all__ = ["LOSS_FORMAT", "RecordError", "RunRecords", "archive_pivot", "Supervisor", "main", "refuse_unusable_checkpoints",
           "supervise"]
