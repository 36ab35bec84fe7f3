"""Request state machine and iteration-level scheduling. Never imports torch or redis."""

from scheduler.config import SchedulerConfig
from scheduler.output import NewRequestData, RequestUpdate, ScheduledChunk, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
