"""The hang doctor: what the ranks' records of their collectives say went wrong.

A hang in data-parallel training is almost always a *desync*: the ranks did not call the same
collectives in the same order with the same tensors. torch keeps a record of each rank's
collectives, the Flight Recorder, on gloo as well as NCCL (see
:func:`~mgtutor.doctor.record.recorder_env`). Read side by side, the records name the
rank that diverged and the collective its peers wait in.

The modules, each with one job:

* :mod:`~mgtutor.doctor.record`: a rank's own record (:func:`own_dump`), from the recorder of
  each backend it uses, with its groups' members and its main thread's stack.
* :mod:`~mgtutor.doctor.responder`: the ranks' side of a hang. :func:`start_dump_responder`
  hands the record out on request while the rank is blocked, and as native code aborts it;
  in the parent :func:`request_dumps` asks for them.
* :mod:`~mgtutor.doctor.reading` and :mod:`~mgtutor.doctor.diagnosis`: :func:`diagnose` reads
  the records and says what went wrong, first line first; :mod:`~mgtutor.doctor.analyzer` adds
  torch's own analyzer's verdicts.
* :mod:`~mgtutor.doctor.drift`: :func:`replica_checksums` and :func:`find_drift` catch the
  quiet bug, replicas that drifted apart.

Where it stands: it imports nothing else of mgtutor; the launcher calls it, in the ranks
(the responder) and in the notebook (the diagnosis of a hang).
"""

from mgtutor.doctor.diagnosis import Diagnosis, diagnose
from mgtutor.doctor.drift import find_drift, replica_checksums
from mgtutor.doctor.record import own_dump, recorder_available, recorder_env
from mgtutor.doctor.responder import (
    DUMP_PATH_ENV,
    aborted_on_gloo,
    default_dump_path,
    read_final_records,
    remove_dump_files,
    request_dumps,
    start_dump_responder,
)

__all__ = [
    "DUMP_PATH_ENV",
    "Diagnosis",
    "aborted_on_gloo",
    "default_dump_path",
    "diagnose",
    "find_drift",
    "own_dump",
    "read_final_records",
    "recorder_available",
    "recorder_env",
    "remove_dump_files",
    "replica_checksums",
    "request_dumps",
    "start_dump_responder",
]
