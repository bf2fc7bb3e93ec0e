"""What each workload sends: a list of `Run`s (rate, request count, lengths), sized by a time budget.

Workloads (issue 32 item 1, issue 33 item 2):
  sweep      random prompts of 2,048 tokens, 256 out, over request rates (Poisson arrivals)
  shapes     512/128 and 8,192/256 at a few rates each
  single     one request at a time (client concurrency 1) at 512, 2,048 and 8,192 prompt tokens:
             a lone prompt's time to first token
  prefix     one shared 2,048-token prefix + 128 unique tokens, 256 out (vLLM's prefix_repetition
             dataset with one prefix), at a few rates
  multiturn  conversations whose every turn resends the whole history (multiturn.py's driver)

Every measured run of a finite rate sends `rate_seconds` of arrivals (at least `min_prompts`);
rate inf sends `inf_prompts` at t = 0.  Each run has its own seed, so no run resends an earlier
run's prompts (a transformer's prefix cache would hit them).  Before the first measured run of each
shape a server gets a throwaway warm-up run of the same shape (another seed: vLLM's own
`--num-warmups` resends the first measured prompt, which the peer's prefix cache then hits).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

INF = math.inf
WORKLOADS = ("sweep", "shapes", "single", "prefix", "multiturn")
CACHING_WORKLOADS = ("prefix", "multiturn")   # run on Laplace with prefix caching on and off


@dataclass(frozen=True)
class Run:
    """One client run against one server.  multiturn: `prompts` conversations of `turns` turns, the
    first turn `in_len` tokens, each later one `user_len` more (after the previous reply), arriving at
    `rate` conversations/s; prefix: `prefix_len` shared tokens + `in_len` unique ones."""
    workload: str
    rate: float
    prompts: int
    in_len: int
    out_len: int
    seed: int
    concurrency: Optional[int] = None
    prefix_len: int = 0
    turns: int = 1
    user_len: int = 0
    warmup: bool = False

    @property
    def shape(self) -> str:
        """'2048/256', '2048+128/256' (prefix), '1024+4x128/128' (multiturn)."""
        if self.workload == "multiturn":
            return f"{self.in_len}+{self.turns - 1}x{self.user_len}/{self.out_len}"
        head = f"{self.prefix_len}+{self.in_len}" if self.prefix_len else f"{self.in_len}"
        return f"{head}/{self.out_len}"

    @property
    def label(self) -> str:
        """A file stem: sweep_2048-256_r12, single_512-64_c1, prefix_2048+128-256_r4_warmup."""
        rate = f"c{self.concurrency}" if self.concurrency else f"r{rate_text(self.rate)}"
        return f"{self.workload}_{self.shape.replace('/', '-')}_{rate}" + ("_warmup" if self.warmup else "")

    def max_len(self) -> int:
        """Tokens of the longest sequence this run makes (prompt + output)."""
        if self.workload == "multiturn":
            return self.in_len + (self.turns - 1) * (self.out_len + self.user_len) + self.out_len
        return self.prefix_len + self.in_len + self.out_len


@dataclass(frozen=True)
class Sizes:
    """The defaults of one machine class (GPU or the CPU smoke run); the command line overrides some."""
    sweep_rates: tuple = (4, 8, 12, 16, 24, 32, 40, INF)
    sweep_shape: tuple = (2048, 256)
    shapes: tuple = (((512, 128), (8, 32, INF)), ((8192, 256), (2, 4, 8)))
    single_lens: tuple = (512, 2048, 8192)
    single_requests: int = 4
    single_out: int = 64
    prefix: tuple = (2048, 128, 256)          # shared prefix, unique tail, output tokens
    prefix_rates: tuple = (4, 12, 24)
    multiturn: tuple = (12, 4, 1024, 128, 128)   # conversations, turns, first turn, user turn, reply
    multiturn_rate: float = 2.0               # conversations arriving per second
    multiturn_think_s: float = 0.5            # from a reply's end to the next turn's request
    rate_seconds: float = 10.0
    min_prompts: int = 40
    inf_prompts: int = 256
    warmup_prompts: int = 8
    warmup_out: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 8192 + 256


# the smoke run's prefixes cover whole blocks of up to 128 (multiturn) and 256 tokens (prefix; 384 =
# 256 + 128, since the token at the end of prefix_repetition's text prefix may merge with the next)
SMOKE = Sizes(sweep_rates=(4, INF), sweep_shape=(64, 8), shapes=(((32, 8), (INF,)), ((160, 8), (INF,))),
              single_lens=(32, 160), single_requests=2, single_out=8, prefix=(384, 16, 8), prefix_rates=(4,),
              multiturn=(2, 3, 160, 16, 8), multiturn_rate=2.0, multiturn_think_s=0.1, rate_seconds=1.5,
              min_prompts=6, inf_prompts=6, warmup_prompts=2, warmup_out=4, max_num_seqs=8, max_model_len=512)


def rate_text(rate: float) -> str:
    """'12', '0.5', 'inf'."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rates(text: str) -> tuple:
    """'4,8,inf' -> (4.0, 8.0, inf); ValueError on a rate that is not > 0."""
    rates = tuple(float(t) for t in text.split(",") if t.strip())
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def parse_shapes(text: str) -> tuple:
    """'512/128@8,32,inf;8192/256@2,4' -> (((512, 128), (8.0, 32.0, inf)), ((8192, 256), (2.0, 4.0)))."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        lens, _, rates = part.partition("@")
        in_len, _, out_len = lens.partition("/")
        if not rates or not int(in_len) > 0 or not int(out_len) > 0:
            raise ValueError(f"a shape is IN/OUT@RATE,RATE,...; got {part!r}")
        out.append(((int(in_len), int(out_len)), parse_rates(rates)))
    return tuple(out)


def prompts_for(rate: float, s: Sizes) -> int:
    """Requests of a measured run at `rate`: `rate_seconds` of arrivals, at least `min_prompts`."""
    return s.inf_prompts if math.isinf(rate) else max(s.min_prompts, round(rate * s.rate_seconds))


def _rated(workload: str, in_len: int, out_len: int, rates, s: Sizes, seed: int, **kw) -> list[Run]:
    """A warm-up run, then one measured run per rate, each with its own seed."""
    warm = Run(workload, INF, s.warmup_prompts, in_len, min(out_len, s.warmup_out), seed + 900, warmup=True, **kw)
    return [warm] + [Run(workload, r, prompts_for(r, s), in_len, out_len, seed + i, **kw)
                     for i, r in enumerate(rates)]


def plan(workloads: list[str], s: Sizes) -> list[Run]:
    """Every run of `workloads`, in order, warm-ups included; the same list for every server."""
    runs: list[Run] = []
    for w in workloads:
        base = 1000 * (WORKLOADS.index(w) + 1)      # seeds differ between workloads too
        if w == "sweep":
            runs += _rated(w, *s.sweep_shape, s.sweep_rates, s, base)
        elif w == "shapes":
            for i, ((in_len, out_len), rates) in enumerate(s.shapes):
                runs += _rated(w, in_len, out_len, rates, s, base + 100 * i)
        elif w == "single":
            for i, n in enumerate(s.single_lens):
                one = Run(w, INF, s.single_requests, n, s.single_out, base + 100 * i, concurrency=1)
                runs += [dataclasses.replace(one, prompts=1, seed=one.seed + 900, warmup=True), one]
        elif w == "prefix":
            shared, unique, out_len = s.prefix
            runs += _rated(w, unique, out_len, s.prefix_rates, s, base, prefix_len=shared)
        elif w == "multiturn":
            conv, turns, first, user, reply = s.multiturn
            one = Run(w, s.multiturn_rate, conv, first, reply, base, turns=turns, user_len=user)
            runs += [dataclasses.replace(one, prompts=min(2, conv), turns=2, seed=base + 900, warmup=True), one]
        else:
            raise ValueError(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
    return runs


def estimate_s(run: Run, capacity: float = INF) -> float:
    """A duration of `run` on one H200 for the time-budget check (from the runs of
    ../shared/notes/online-serving.md, 3B, 2,048/256: TPOT 6-16 ms unsaturated; 480 requests at 12 req/s
    took ~41 s): arrivals at min(rate, the server's measured capacity), rate inf ~40 ms a request, then
    ~12 ms per output token of the last request, plus ~3 s of client set-up."""
    drain = 0.012 * run.out_len + 3
    if run.workload == "multiturn":
        return run.prompts / run.rate + run.turns * (0.012 * run.out_len + 1.0) + 3
    if run.concurrency:
        return run.prompts * (0.15 + 0.012 * run.out_len) + 3
    rate = min(run.rate, capacity)
    return (run.prompts / rate if math.isfinite(rate) else 0.04 * run.prompts) + drain
