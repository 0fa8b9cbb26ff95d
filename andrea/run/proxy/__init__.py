"""The training proxy: supervision of the engine process (supervision.py) and the run's records
(records.py, which documents the record formats; journal.py, the history journal; aside.py,
previous/ and the pivot archive; trackers.py, the experiment trackers)."""
from .aside import archive_pivot
from .records import LOSS_FORMAT, RecordError, RunRecords
from .supervision import Supervisor, main, refuse_unusable_checkpoints, supervise

__all__ = ["LOSS_FORMAT", "RecordError", "RunRecords", "archive_pivot", "Supervisor", "main", "refuse_unusable_checkpoints",
           "supervise"]
