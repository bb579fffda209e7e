"""The message catalogue: every message that crosses an actor boundary.

All messages are frozen, tagged msgspec Structs (array_like, gc=False) so that
they encode fast and small into the event log and decode back to the same
objects for replay. Changing a field is a schema change: bump SCHEMA_VERSION
and teach `imp.log.upcast` to read the old form.

Why a package of conversations, re-exported here: the catalogue is read by
conversation (what the scheduler and the executor say to each other is one
page, the Responses store's protocol another), and a single 780-line module
hid that. What must stay one thing stays here, in this file: SCHEMA_VERSION
and the ONE tagged union `Message` the event log decodes. A tag is the class
name, not its module, so where a class lives is not part of the schema; field
order (array_like) is, and is untouched. Import from `imp.messages` (every
name is re-exported); the modules import only `base` and each other, downward:

    base      Msg, Struct, FinishReason
    params    SamplingParams (+ its policy predicates), Constraint
    request   ingress -> admission -> scheduler: Submit, Reject, Enqueue, Cancel, EndThinking,
              SessionClose, Suspend, Resume, Finished, Tick
    step      one engine step: KvRequest/KvReply (KvOp, KvResult, KvFigures), StepPlan/StepResult/
              StepFailed (SeqWork, SampledToken, PromptLogprob), TokenOut/TokenBatch
    output    ingress <-> detok: DetokOpen, DetokClose, Delta, DeltaBatch
    reports   -> metrics: Figures (QueueFigures), StepStats, RequestStats; Fault
    ops       suspend's memory and LoRA: Unload, Reload, MemoryState, KvForget, LoraLoad/Unload/State
    store     the Responses store's requests and StoreReply

Actor names (receivers/senders in the log):
    ingress    HTTP front door; owns request handles and their output queues
    admission  capacity checks, reservations, queued-token limits
    scheduler  continuous batching; decides every step
    kv         KV block allocator (paged blocks, refcounts, prefix cache)
    executor   runs model steps (one per device)
    detok      incremental detokenizer, stop strings, stream fan-out
    metrics    figures for /metrics and /health
    clock      ticks (time enters the cores only through messages)

Flow of one request (docs/STEP.md: one step's messages in order):
    ingress -Submit-> admission -Enqueue-> scheduler          (or admission -Reject-> ingress)
    scheduler -KvRequest-> kv -KvReply-> scheduler            (once per step)
    scheduler -StepPlan-> executor -StepResult-> scheduler    (once per step)
    scheduler -TokenBatch-> detok -DeltaBatch-> ingress       (per scheduler decision)
    ingress -Cancel-> admission -Cancel-> scheduler           (disconnect / stop string)
    scheduler -Finished-> admission                           (releases queued-token accounting)
    ingress -Suspend/Resume-> admission                       (POST /admin/suspend, /admin/resume)
"""

from __future__ import annotations

from typing import Union

from imp.messages.base import FinishReason, Msg, Struct
from imp.messages.ops import (KvDrop, KvForget, KvLoad, KvLoaded, KvReady, KvSave, KvStored, KvSwapIn, KvSwapOut,
                              LoraLoad, LoraState, LoraUnload, MemoryState, Reload, Unload)
from imp.messages.output import Delta, DeltaBatch, DetokClose, DetokOpen
from imp.messages.params import Constraint, Dry, SamplingParams
from imp.messages.reports import Fault, Figures, QueueFigures, RequestStats, StepStats
from imp.messages.request import (Cancel, EndThinking, Enqueue, Finished, Reject, Resume, SessionClose, Submit,
                                  Suspend, Tick, TokenTexts)
from imp.messages.step import (PENDING_TOKEN, DecodeRows, KvFigures, step_result, KvOp, KvReply, KvRequest, KvResult, LensLayer,
                               PromptLogprob,
                               SampledToken, SeqWork, StepFailed, StepPlan, StepResult, TokenBatch, TokenOut, TokenRows,
                               token_rows)
from imp.messages.store import (ChainLink, StoreDelete, StoreGet, StoreGetChain, StoreItem, StoreListInputItems,
                                StorePut, StoreReply, StoreStatus, StoreSweep)

# 2: SeqWork.pending, params sent once per admission, replica names
# 3: tuples for every sequence, Enqueue wraps its Submit, Delta wraps its TokenOut
SCHEMA_VERSION = 3

# the one tagged union every event-log payload decodes as (tags are class names)
Message = Union[
    Submit,
    Reject,
    Enqueue,
    Cancel,
    EndThinking,
    SessionClose,
    Finished,
    Tick,
    TokenTexts,
    Suspend,
    Resume,
    KvRequest,
    KvReply,
    StepPlan,
    StepResult,
    StepFailed,
    TokenOut,
    TokenBatch,
    TokenRows,
    DeltaBatch,
    DetokOpen,
    DetokClose,
    Delta,
    Figures,
    RequestStats,
    StepStats,
    Fault,
    Unload,
    Reload,
    MemoryState,
    KvForget,
    KvStored,
    KvSave,
    KvLoad,
    KvLoaded,
    KvDrop,
    KvReady,
    KvSwapOut,
    KvSwapIn,
    LoraLoad,
    LoraUnload,
    LoraState,
    StorePut,
    StoreGet,
    StoreGetChain,
    StoreDelete,
    StoreListInputItems,
    StoreSweep,
    StoreReply,
]

__all__ = [
    "SCHEMA_VERSION", "Message", "Msg", "Struct", "FinishReason", "PENDING_TOKEN",
    "Constraint", "Dry", "SamplingParams",
    "Submit", "Reject", "Enqueue", "Cancel", "EndThinking", "SessionClose", "Suspend", "Resume", "Finished", "Tick",
    "TokenTexts",
    "KvOp", "KvResult", "KvFigures", "KvRequest", "KvReply", "SeqWork", "DecodeRows", "step_result", "SampledToken", "PromptLogprob", "LensLayer",
    "StepPlan", "StepResult", "StepFailed", "TokenOut", "TokenBatch", "TokenRows", "token_rows",
    "DetokOpen", "DetokClose", "Delta", "DeltaBatch",
    "QueueFigures", "Figures", "StepStats", "RequestStats", "Fault",
    "Unload", "Reload", "MemoryState", "KvForget", "KvStored", "KvSave", "KvLoad", "KvLoaded", "KvDrop", "KvReady",
    "KvSwapOut", "KvSwapIn", "LoraLoad", "LoraUnload", "LoraState",
    "StoreStatus", "StoreItem", "ChainLink", "StorePut", "StoreGet", "StoreGetChain", "StoreDelete",
    "StoreListInputItems", "StoreSweep", "StoreReply",
]
