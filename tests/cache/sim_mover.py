"""A tensor-free KVMover for unit tests: records every copy and the host bytes it holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class SimHostKV:
    """Stands for a host buffer: which device blocks it was copied from, and its size."""

    serial: int
    source_blocks: tuple[int, ...]
    num_tokens: int


@dataclass(slots=True)
class SimulatedMover:
    """host_nbytes = num_tokens * bytes_per_token; logs swap_out/swap_in/free_host calls."""

    bytes_per_token: int = 100
    swap_outs: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    swap_ins: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    live: dict[int, SimHostKV] = field(default_factory=dict)
    _next: int = 0

    def swap_out(self, blocks: Sequence[int], num_tokens: int) -> SimHostKV:
        self._next += 1
        kv = SimHostKV(self._next, tuple(blocks), num_tokens)
        self.live[kv.serial] = kv
        self.swap_outs.append((tuple(blocks), num_tokens))
        return kv

    def swap_in(self, host_kv: SimHostKV, blocks: Sequence[int]) -> None:
        assert host_kv.serial in self.live, "swap_in of a freed host buffer"
        self.swap_ins.append((host_kv.serial, tuple(blocks)))

    def host_nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def kv_tokens(self, host_kv: SimHostKV) -> int:
        return host_kv.num_tokens

    def free_host(self, host_kv: SimHostKV) -> None:
        assert host_kv.serial in self.live, "double free of a host buffer"
        del self.live[host_kv.serial]
        self.frees.append(host_kv.serial)

    @property
    def live_bytes(self) -> int:
        return sum(self.host_nbytes(kv.num_tokens) for kv in self.live.values())
