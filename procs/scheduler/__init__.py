"""The scheduler: the chapter's continuous batching as a pure-Python core (no torch, no sockets).

Public API: `SchedulerConfig`, `Scheduler`, `StepOutput`, `Executor`, `ScriptedExecutor`; a request the
scheduler refuses raises `shared.errors.Refusal`. `procs.scheduler.simulate` is the `batchserve simulate`
command; `procs.scheduler.process` the scheduler process's loop.
"""

from batchserve.procs.scheduler.config import POLICIES, Policy, SchedulerConfig, SchedulerConfigError
from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.executor import Executor, ExecutorError, ScriptedExecutor
from batchserve.procs.scheduler.kv_allocator import KVAllocatorError
from batchserve.procs.scheduler.step_output import LaunchedStep, StepOutput

__all__ = [
    "POLICIES",
    "Policy",
    "SchedulerConfig",
    "SchedulerConfigError",
    "Scheduler",
    "StepOutput",
    "LaunchedStep",
    "Executor",
    "ExecutorError",
    "ScriptedExecutor",
    "KVAllocatorError",
]
