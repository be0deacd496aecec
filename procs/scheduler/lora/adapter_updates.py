"""Which LoRA adapters the worker holds, decided in the scheduler process: the loads and unloads each step
takes to the worker (`ForwardBatch.adapter_updates`, applied before its slot starts).

Registered adapters are those of `--lora-modules` and those loaded at run time (`shared.messages.AdapterUpdate`
from the api, on the requests' own socket, so a request naming one never arrives before it). The worker
holds at most `--max-cpu-loras` of them (0: all), least recently admitted first out:
- a runtime load goes with the next step;
- a step that starts a slot on an adapter the worker does not hold loads it first, unloading the least
  recently used one no admitted request runs if the worker is full (`--max-cpu-loras` is at least
  `--max-loras`, so one always is);
- an adapter unloaded at run time leaves the worker once no request of it is left, waiting or running:
  the requests in flight finish on its weights (the api already answers a new request naming it with 404).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypedDict

from batchserve.procs.scheduler.executor import Executor
from batchserve.procs.scheduler.request import Request, Status
from batchserve.shared.config import ServerConfig
from batchserve.shared.lora import LoraModule, held_at_start, parse_lora_modules
from batchserve.shared.messages import AdapterUpdate, ForwardBatch, StepResult

ADMITTED = (Status.RUNNING, Status.PREFILLING)  # requests holding a slot: their adapters stay in the worker


class WorkerAdapters:
    def __init__(self, config: ServerConfig) -> None:
        modules = parse_lora_modules(config.lora_modules) if config.enable_lora else []
        self.registered: dict[int, LoraModule] = dict(enumerate(modules, 1))
        self.limit = config.max_cpu_loras  # adapters the worker holds at once (0: all)
        held = range(1, len(held_at_start(modules, self.limit)) + 1)  # as the worker loads them at start
        self.held: OrderedDict[int, None] = OrderedDict.fromkeys(held)  # least recently admitted first
        self._unloading: list[AdapterUpdate] = []  # unregistered, waiting for their last request

    def update(self, update: AdapterUpdate) -> None:
        """The api's runtime load or unload."""
        if update.path:
            self.registered[update.index] = LoraModule(update.name, update.path)
        else:
            self.registered.pop(update.index, None)
            self._unloading.append(update)

    def due(self, batch: ForwardBatch, requests: Iterable[Request]) -> list[AdapterUpdate]:
        """The updates `batch` carries, in order: the unloads that are due, then the loads of the adapters
        its slot starts need (and of adapters loaded at run time), each after what makes room for it."""
        requests = list(requests)
        in_use = {r.params.adapter for r in requests}
        admitted = {r.params.adapter for r in requests if r.status in ADMITTED}
        updates = [u for u in self._unloading if u.index not in in_use]
        self._unloading = [u for u in self._unloading if u.index in in_use]
        for update in updates:
            self.held.pop(update.index, None)
        wanted = [s.adapter for s in batch.slot_starts if s.adapter]
        wanted += [i for i in self.registered if i not in self.held and not self.limit]  # runtime loads, no limit
        for index in wanted:
            if index not in self.held:
                updates += self._make_room(admitted | set(wanted) | {u.index for u in self._unloading})
                module = self.registered[index]
                updates.append(AdapterUpdate(index=index, name=module.name, path=module.path))
            self.held[index] = None
            self.held.move_to_end(index)
        return updates

    def _make_room(self, keep: set[int]) -> list[AdapterUpdate]:
        """Unload the least recently admitted adapter outside `keep` while the worker is full (none outside
        it: the worker holds one more for a while, until the unloads waiting for their requests are done). A
        victim is registered: an unregistered adapter the worker holds waits in `_unloading`, which `keep` holds."""
        victim = next((i for i in self.held if i not in keep), None)
        if not self.limit or len(self.held) < self.limit or victim is None:
            return []
        del self.held[victim]
        return [AdapterUpdate(index=victim, name=self.registered[victim].name)]


class AdaptersInUse(TypedDict, total=False):
    """`SchedulerStats`' adapter fields (left out: none)."""

    running_adapters: list[int]
    waiting_adapters: list[int]


def adapters_in_use(requests: Iterable[Request]) -> AdaptersInUse:
    """The adapters of the requests running (admitted) and waiting, as `SchedulerStats` reports them (for
    vLLM's `vllm:lora_requests_info`, which routers read)."""
    running: set[int] = set()
    waiting: set[int] = set()
    for request in requests:
        if request.params.adapter:
            (running if request.status in ADMITTED else waiting).add(request.params.adapter)
    return {"running_adapters": sorted(running), "waiting_adapters": sorted(waiting)}


class AdapterHoldingExecutor:
    """An executor that gives each batch the adapter loads and unloads `WorkerAdapters` decides: the offline
    engine's (the server's scheduler process does the same before it sends a batch)."""

    def __init__(self, inner: Executor, adapters: WorkerAdapters, requests: Callable[[], Iterable[Request]]) -> None:
        self.inner, self.adapters, self.requests = inner, adapters, requests

    def execute(self, batch: ForwardBatch) -> StepResult:
        batch.adapter_updates = self.adapters.due(batch, self.requests())
        return self.inner.execute(batch)
