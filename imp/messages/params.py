"""What a request asks of the sampler: `SamplingParams` (resolved by ingress, carried by `Submit`
and a sequence's first `SeqWork`) and its policy predicates, and the output's `Constraint`."""

from __future__ import annotations

from imp.messages.base import Struct


class Constraint(Struct):
    """What a sequence's output must match (compiled by `imp.constrain`; plain data here, so
    it rides in the log and replay rebuilds the same grammar). kind: json_schema (source =
    the schema as JSON text), json_object, regex (whole output), lark (llguidance's Lark,
    also the forced tool-call grammars), gbnf (llama.cpp's). strict: OpenAI's strict
    json_schema semantics."""

    kind: str
    source: str = ""
    strict: bool = False


class Dry(Struct):
    """DRY (imp.sampling.dry, llama.cpp's fields): a token extending a repeat of length L >= allowed_length in
    the last `last_n` tokens of prompt + output (-1: all) loses multiplier * base ^ (L - allowed_length);
    breakers: (head token, tail tokens) pairs of the sequence breakers (imp.sampling.dry.breaker_table);
    prefix: the prompt's last tokens inside the window."""

    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    last_n: int = 64
    breakers: tuple[tuple[int, tuple[int, ...]], ...] = ()
    prefix: tuple[int, ...] = ()


class SamplingParams(Struct):
    """Resolved sampling settings (defaults already applied by ingress)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering (ingress maps the API's 0 -> 50)
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # always set: ingress draws one when the client gave none
    stop_token_ids: tuple[int, ...] = ()  # EOS etc.; ends with STOP
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1  # -1 = none; k >= 0 = sampled token's logprob + top k
    # -1 = none; k >= 0 = each prompt token's raw logprob + top k (vLLM prompt_logprobs).
    # Such a request never reuses cached prefix blocks: every prompt row is forwarded.
    prompt_logprobs: int = -1
    # the output's grammar (structured output, a forced tool call); its mask is applied to the
    # logits before anything else, so logprobs read a masked token as probability 0
    constraint: Constraint | None = None
    # the LoRA adapter the sequence runs with (its id from POST /admin/lora/load; 0 = the base
    # model). Carried with the params: the executor keeps them per sequence already.
    lora: int = 0
    # /v1/score: the logprobs of these ids at each sampled position, in this order, in place of
    # the top-k (SampledToken.top); asked with logprobs >= 0, so the host sampler answers
    score_ids: tuple[int, ...] = ()
    # draft-free speculation (imp.core.spec) for this sequence: the request's "speculative", else the
    # server's --speculative. It never changes the output, only how many tokens a step may yield
    speculative: bool = False
    # {"speculative": {"mtp_k": N}}: the MTP head's chain depth asked for (-1 = not asked); no file
    # this server loads has a head, so N > 0 is declined (usage says so) and the matcher runs
    mtp_k: int = -1
    dry: Dry | None = None  # DRY sampling (None: off)
    # mirostat (imp.sampling.mirostat, llama.cpp's): 1 or 2 replaces top-k/top-p/min-p/typical with a cut that
    # steers each token's surprise to tau; 0 = off
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # banned phrases (imp.core.banned): a completed one rewinds the sequence to the token it starts in and
    # bans that token there (SeqWork.banned); strings match ASCII-case-insensitively, regexes are Python `re`
    banned_strings: tuple[str, ...] = ()
    banned_regex: tuple[str, ...] = ()
    # the logit lens: top N per layer (0 = off); SampledToken.lens
    logit_lens: int = 0
    # classifier-free guidance (llama.cpp's cfg_scale): > 1 samples from l_b + s (l_a - l_b), l_b the shadow
    # sequence's logits (Submit.cfg_prompt) at the same position (SeqWork.guide); 1 = off
    cfg_scale: float = 1.0

    # The sampling policy, decided here once: every runner, sampler and the
    # scheduler ask these instead of re-testing the fields.
    @property
    def banned(self) -> bool:
        """Banned strings or regexes: the scheduler watches the text and rewinds."""
        return bool(self.banned_strings or self.banned_regex)

    @property
    def drafts(self) -> bool:
        """Drafted tokens may be fed for it (speculation asked): not where a rewind cuts the text the
        drafter reads (banned phrases), nor where each token wants its own forward (the logit lens) or a
        shadow's row beside it (classifier-free guidance)."""
        return self.speculative and not self.banned and not self.logit_lens and self.cfg_scale == 1.0

    @property
    def greedy(self) -> bool:
        """The draw is an argmax (of the biased, penalized logits)."""
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """A repetition/presence/frequency penalty applies: the sampler needs the history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def constrained(self) -> bool:
        """A grammar masks the logits before sampling."""
        return self.constraint is not None

    @property
    def needs_history(self) -> bool:
        """The sampler needs the generated tokens (penalties count them; a grammar's state
        is a function of them): the scheduler sends them with a sequence's first share after
        each admission, and the executor keeps them (SchedulerConfig.history_once; before it,
        with every share that samples)."""
        return self.penalized or self.constraint is not None or self.dry is not None

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits, nothing else asked: a batch of these is one argmax."""
        return (self.greedy and self.logprobs < 0 and not self.logit_bias and not self.penalized
                and self.constraint is None and self.dry is None and not self.mirostat)

    @property
    def host_sampled(self) -> bool:
        """Needs the CPU sampler even on a GPU (logprobs, typical_p, score_ids, DRY, mirostat)."""
        return (self.logprobs >= 0 or (self.typical_p < 1.0 and not self.greedy) or bool(self.score_ids)
                or self.dry is not None or self.mirostat > 0)
