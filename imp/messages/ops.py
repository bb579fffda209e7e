"""Operations across the actors: suspend's memory (POST /admin/suspend,
--idle-unload-seconds) and the LoRA table, ingress -> executor / kv and back."""

from __future__ import annotations

from imp.messages.base import Msg


class Unload(Msg):
    """ingress -> executor: release the weights and the KV pool (nothing is running: the
    caller drained first). The next StepPlan, or a Reload, loads them again."""

    reason: str = "operator"  # "operator" (POST /admin/suspend) or "idle"


class Reload(Msg):
    """ingress -> executor: load the weights and the KV pool again now (POST /admin/resume)."""


class MemoryState(Msg):
    """executor -> ingress: after an Unload or a (re)load. Resident bytes of the process and,
    on a GPU, the card's free bytes, read before and after (0 when not measured)."""

    actor: str
    loaded: bool
    reason: str
    seconds: float
    rss_before: int = 0
    rss_after: int = 0
    device_free_before: int = 0
    device_free_after: int = 0
    error: str = ""


class LoraLoad(Msg):
    """ingress -> executor: read the adapter at `path` (already confined to --lora-dir) and
    hold it under `lora_id`; sequences whose params.lora is that id run with it."""

    lora_id: int
    name: str
    path: str


class LoraUnload(Msg):
    """ingress -> executor: drop the adapter (no sequence uses it: ingress waited)."""

    lora_id: int


class LoraState(Msg):
    """executor -> ingress: after a LoraLoad / LoraUnload; error says why a load failed."""

    actor: str
    lora_id: int
    loaded: bool
    error: str = ""
    nbytes: int = 0


class KvForget(Msg):
    """ingress -> kv: the pool's contents are gone (unloaded): drop the prefix cache and the
    pins. Sent only while no sequence is live."""


# The prefix cache's disk tier (--prompt-cache-dir; imp.core.kv, imp.actors.kvtier). A key is a block's chained
# hash (model fingerprint and salt in its root), so a file is only ever read for the same tokens, model, adapter.


class KvStored(Msg):
    """engine -> kv, at boot: the keys the disk tier holds (oldest first), read from its directory."""

    keys: tuple[bytes, ...]


class KvSave(Msg):
    """kv -> executor: write block `block`'s KV to the tier under `key` (it just became a cache entry; the
    executor gets this before any step that could write over the block)."""

    block: int
    key: bytes


class KvLoad(Msg):
    """kv -> executor: fill block `block` from the tier's `key`; answered with KvLoaded."""

    block: int
    key: bytes


class KvLoaded(Msg):
    """executor -> kv: a KvLoad done (ok) or not (the file was missing, corrupt or foreign)."""

    key: bytes
    block: int
    ok: bool
    source: str = ""  # where an ok one came from: "host" (the host tier) or "disk"


class KvDrop(Msg):
    """kv -> executor: the tier is past its size: delete `key`'s file."""

    key: bytes


class KvReady(Msg):
    """kv -> scheduler: tier blocks landed in the pool; an alloc that waited for them may run now."""


# Swap instead of recompute (imp.core.kv, `swap_blocks`): a preempted sequence's KV parked in the executor's host
# swap area (pinned memory on a GPU) and put back when it runs again. No reply: the executor does them in order
# with the steps, so a copy out precedes any step that writes over the blocks, and a copy in any step that reads them.


class KvSwapOut(Msg):
    """kv -> executor: copy blocks[i] to swap slot slots[i] (before any later step writes over them)."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]


class KvSwapIn(Msg):
    """kv -> executor: copy swap slot slots[i] back into block blocks[i] (before any later step reads them)."""

    slots: tuple[int, ...]
    blocks: tuple[int, ...]
