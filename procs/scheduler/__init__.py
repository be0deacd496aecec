"""The scheduler: the chapter's continuous batching as a pure-Python core (no torch, no sockets).

Public API: `SchedulerConfig`, `Scheduler`, `StepOutput`, `RequestRejectedError`, `Executor`,
`ScriptedExecutor`. `procs.scheduler.simulate` is the `batchserve simulate` command.
"""

from procs.scheduler.config import POLICIES, Policy, SchedulerConfig, SchedulerConfigError
from procs.scheduler.core import LaunchedStep, RequestRejectedError, Scheduler, StepOutput
from procs.scheduler.executor import Executor, ExecutorError, ScriptedExecutor
from procs.scheduler.kv_allocator import KVAllocatorError

__all__ = [
    "POLICIES", "Policy", "SchedulerConfig", "SchedulerConfigError", "RequestRejectedError", "Scheduler",
    "StepOutput", "LaunchedStep", "Executor", "ExecutorError", "ScriptedExecutor", "KVAllocatorError",
]
