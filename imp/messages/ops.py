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
