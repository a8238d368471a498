"""VLM judges as rewards: ``vlm_judge`` (a local transformers VLM) and ``vlm_judge_http`` (a served one).

Both score decoded samples against their prompts in one of the modes of
``docs/methods/vlm_judges.md``:

* ``weighted`` (default): the reply is forced to start with ``prefix`` ("Score:"); from the next-token
  log-probs over the single-token digits "1".."K" (and their leading-space variants), softmaxed over
  those only, ``s = Σ k·p_k`` ∈ [1, K]. Deterministic, no sampling. [common practice]
* ``yesno``: prefix "Answer:", ``s = P(Yes) / (P(Yes) + P(No))`` ∈ [0, 1].
* ``text``: the judge writes its verdict ("Score: 4", "Alignment Score (1-5): 4", ``<answer>4</answer>``);
  it is parsed per label, then by the first number (:func:`rewards.vlm_parse.parse_score`). [UnifiedReward]
* ``rubric`` (Thinking Reward Model): the judge writes a JSON rubric once per prompt (cached, so every
  member of a GRPO group is judged on the same rubric), then scores each criterion 0-10;
  ``R = Σ w_k·s_k/10`` ∈ [0, 1]. [abstract; details derived]
* ``think`` (TRM's three stages in full): the same cached rubric per prompt; the judge then writes an
  assessment of the sample against each criterion and ends with one overall verdict ``Score: x`` (0-10);
  ``R = x/10`` ∈ [0, 1]. A reply without the assessment or without the final score is invalid
  (:func:`rewards.vlm_parse.parse_thinking`). [abstract; reply format derived]
* ``trm`` / ``trm_edit``: the Thinking Reward Model's released protocol, for a TRM-T2I / TRM-Edit
  checkpoint: its system prompt and user text word for word (:mod:`rewards.vlm_trm_prompts`), the image
  (``trm_edit``: the source image ``metadata["image"]``, then the edited one), one call per sample, the
  chat template's thinking switch off, greedy, up to 4096 / 1536 new tokens. The reply is a JSON
  checklist whose ``final_score`` (0-10, clamped) gives ``R = final_score/10`` ∈ [0, 1]
  (:func:`rewards.vlm_parse.parse_checklist`). Images only. [authors' code]
* ``pairwise``: samples sharing a prompt are compared two by two in both orders ("Better image: 1|2",
  probability-weighted); a sample's score is its mean win probability against its group ∈ [0, 1],
  a Bradley-Terry win rate for group-relative training. A group of G costs G(G−1) judge calls. [derived]

A sample whose judge call failed (unreachable server, timeout) or whose reply is not a score is
invalid (``RewardOutput.valid`` False, the reason in ``info``), never scored 0 and never a crash;
``stats`` counts them and a warning is logged per batch. Videos ``(B,F,3,H,W)`` are judged on
``num_frames`` frames sampled evenly per clip, sent as images in order. Images are handed to the judge
at their own resolution: the judge's processor resizes them.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from flowalign.sampling.inputs import load_input_image
from rewards import vlm_trm_prompts
from rewards.common import check_lengths, check_unit_range, to_pil
from rewards.planning import existing, holds_nothing, missing, on_accelerator, option
from rewards.registry import register
from rewards.vlm_backend import ChatRequest, Completion
from rewards.vlm_parse import (Criterion, choice_from_text, choice_probs, parse_checklist, parse_rubric, parse_score,
                               parse_thinking, rubric_reward, weighted_score)

log = logging.getLogger("flowalign.rewards.vlm_judge")

MODES = ("weighted", "yesno", "text", "rubric", "think", "trm", "trm_edit", "pairwise")
#: modes that send a released checkpoint's own prompts: no question or prefix of ours, images only
TRM_MODES = {"trm": (vlm_trm_prompts.T2I_SYSTEM, vlm_trm_prompts.T2I_USER),
             "trm_edit": (vlm_trm_prompts.EDIT_SYSTEM, vlm_trm_prompts.EDIT_USER)}
#: a reply's length when ``max_tokens`` is not given: the TRM modes' are their inference scripts' defaults
MAX_TOKENS = {"trm": 4096, "trm_edit": 1536}

QUESTIONS = {
    "weighted": ('You are a strict judge of generated {media}s. Prompt: "{prompt}". How well does the {media}'
                 " match the prompt? Rate it from 1 (not at all) to {K} (perfectly). Answer with the score only."),
    "yesno": 'Does the {media} match the prompt "{prompt}"? Answer Yes or No.',
    "text": ('You are a strict judge of generated {media}s. Prompt: "{prompt}". Rate how well the {media} matches'
             " the prompt from 1 to {K}. Reply in the form \"Score: x\"."),
    "rubric": ('Write a rubric for judging {media}s generated for the prompt "{prompt}" as JSON: a list of'
               ' criteria, each {{"name", "description", "weight"}}, the weights summing to 1. Reply with the JSON'
               " only."),
    "criteria": ('Judge the {media} generated for the prompt "{prompt}" on each criterion of this rubric:\n'
                 "{criteria}\nScore each criterion from 0 to 10 and reply with one line per criterion, in the"
                 ' form "<name>: <score>".'),
    "assess": ('Judge the {media} generated for the prompt "{prompt}" against this rubric:\n{criteria}\n'
               'Think first: write "Assessment:" and, for each criterion, what the {media} shows and how well it'
               ' meets it. Then end with the overall score from 0 to 10 on its own line, as "Score: x".'),
    "pairwise": ('Prompt: "{prompt}". Which of the two {media}s matches the prompt better, {media} 1 or'
                 " {media} 2? Answer 1 or 2."),
}
PREFIXES = {"weighted": "Score:", "yesno": "Answer:", "pairwise": "Better {media}:"}
# rubric used when the judge's rubric cannot be read (cached like a real one) [derived]
FALLBACK_RUBRIC = [Criterion("prompt alignment", "the image shows what the prompt asks for", 1.0)]


class VLMJudge:
    """The judge on top of a backend with ``complete(list[ChatRequest]) -> list[Completion]``.

    Options (all modes): ``mode`` (one of :data:`MODES`), ``scale`` K (weighted/text scores lie in
    [1, K]; 2..9 so every score is one digit token), ``question`` (a template with ``{prompt}``,
    ``{media}``, ``{K}`` replacing the mode's default), ``prefix`` (forced reply start),
    ``top_logprobs`` (alternatives read per position; digits outside them count 0, ``info`` reports
    the mass found), ``labels`` and ``max_tokens`` / ``temperature`` (text, rubric, think and TRM modes; 0
    is greedy; ``max_tokens`` defaults to 64, the TRM modes' to :data:`MAX_TOKENS`), ``num_frames``
    (videos), ``rubric_cache_size`` and ``rubric_tokens`` (the rubric reply's length), ``seed`` (sampling
    at temperature > 0), ``enable_thinking`` (the chat template's thinking switch of a Qwen3-style judge;
    None leaves the template's default, the TRM modes turn it off as their authors' scripts do).
    """

    name = "vlm_judge"
    differentiable = False

    def __init__(self, backend: Any, *, mode: str = "weighted", scale: int = 9, question: str | None = None,
                 prefix: str | None = None, top_logprobs: int = 20, labels: list[str] | tuple[str, ...] = ("Score",),
                 max_tokens: int | None = None, temperature: float = 0.0, num_frames: int = 4,
                 rubric_cache_size: int = 4096, rubric_tokens: int = 512, seed: int | None = None,
                 enable_thinking: bool | None = None):
        who = self.name
        if mode not in MODES:
            raise UserError(f"{who} reward: mode={mode!r} is not one of {list(MODES)}")
        if mode in TRM_MODES and (question is not None or prefix is not None):
            raise UserError(f"{who} reward: mode={mode!r} sends the TRM checkpoint's own prompts; drop"
                            f" {'question' if question is not None else 'prefix'} (or use mode: think)")
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise UserError(f"{who} reward: enable_thinking={enable_thinking!r} must be true, false or null")
        max_tokens = MAX_TOKENS.get(mode, 64) if max_tokens is None else max_tokens
        if isinstance(scale, bool) or not isinstance(scale, int) or not 2 <= scale <= 9:
            raise UserError(f"{who} reward: scale={scale!r} must be an integer in 2..9 (scores are single digits)")
        for key, value, lo in (("top_logprobs", top_logprobs, 1), ("max_tokens", max_tokens, 1),
                               ("num_frames", num_frames, 1), ("rubric_cache_size", rubric_cache_size, 1),
                               ("rubric_tokens", rubric_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise UserError(f"{who} reward: {key}={value!r} must be an integer >= {lo}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise UserError(f"{who} reward: temperature={temperature!r} must be >= 0 (0 is greedy)")
        if isinstance(labels, str) or not labels or not all(isinstance(x, str) and x.strip() for x in labels):
            raise UserError(f"{who} reward: labels={labels!r} must be a non-empty list of names, e.g. ['Score']")
        if question is not None and "{prompt}" not in question:
            raise UserError(f"{who} reward: question must contain '{{prompt}}' where the prompt goes; got {question!r}")
        if prefix is not None:
            try:
                prefix.format(media="image")
            except (KeyError, IndexError, ValueError) as e:
                raise UserError(f"{who} reward: prefix={prefix!r} has an unknown placeholder ({e}); only {{media}}"
                                " may appear, and {{ }} for literal braces") from e
        if question is not None:
            try:
                question.format(prompt="p", media="image", K=scale)
            except (KeyError, IndexError, ValueError) as e:
                raise UserError(f"{who} reward: question={question!r} has an unknown placeholder ({e}); use only"
                                " {prompt}, {media}, {K}, and {{ }} for literal braces") from e
        self.backend, self.mode, self.K = backend, mode, scale
        #: pairwise scores are win rates among the samples sharing a prompt (a judge for pref_grpo)
        self.pairwise = mode == "pairwise"
        # the think mode's rubric is written as the rubric mode's is
        # (the TRM modes ask TRM_MODES' texts instead)
        self.question = question or QUESTIONS.get("rubric" if mode == "think" else mode, "")
        self.prefix = prefix if prefix is not None else PREFIXES.get(mode, "")
        self.top_logprobs, self.labels = top_logprobs, tuple(labels)
        self.max_tokens, self.temperature, self.num_frames, self.seed = max_tokens, float(temperature), num_frames, seed
        self.rubrics: OrderedDict[str, list[Criterion]] = OrderedDict()
        self.rubric_cache_size, self.rubric_tokens = rubric_cache_size, rubric_tokens
        if enable_thinking is None and mode in TRM_MODES:
            enable_thinking = False
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        self.stats: Counter[str] = Counter()

    # --- inputs ------------------------------------------------------------------------------------

    def _check(self, samples: Any, prompts: list[str], metadata: list[dict[str, Any]]) -> None:
        who = self.name
        if not isinstance(samples, torch.Tensor) or samples.ndim not in (4, 5) or samples.shape[-3] != 3:
            shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
            raise UserError(f"{who} reward: samples must be images (B, 3, H, W) or videos (B, F, 3, H, W); got {shape}")
        check_unit_range(samples, who)
        check_lengths(samples.shape[0], prompts, metadata, who)
        if self.mode in TRM_MODES and samples.ndim == 5:
            raise UserError(f"{who} reward: mode={self.mode!r} judges images (a TRM checkpoint sees one image); for"
                            " videos use mode: think or text")
        if self.mode == "trm_edit":
            missing = [i for i in range(samples.shape[0]) if not metadata or not metadata[i]
                       or metadata[i].get("image") is None]
            if missing:
                raise UserError(f"{who} reward: mode='trm_edit' judges an edit against its source image, but"
                                f" metadata[{missing[0]}] has no 'image'; use an editing dataset or mode: trm")

    def _media(self, sample: torch.Tensor) -> tuple[str, list[dict[str, Any]]]:
        """One sample as message parts: an image, or ``num_frames`` evenly spaced frames of a video."""
        if sample.ndim == 3:
            return "image", [{"type": "image", "image": to_pil(sample)}]
        idx = torch.linspace(0, sample.shape[0] - 1, min(self.num_frames, sample.shape[0])).round().long()
        parts = [{"type": "image", "image": to_pil(sample[i])} for i in idx.tolist()]
        return "video", parts + [{"type": "text", "text": f"These {len(parts)} images are frames of one video, in order. "}]

    def _request(self, parts: list[dict[str, Any]], text: str, prefix: str, *, system: str | None = None,
                 **kw: Any) -> ChatRequest:
        kw.setdefault("seed", self.seed)
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": parts + [{"type": "text", "text": text}]})
        return ChatRequest(messages, assistant_prefix=prefix, template_kwargs=dict(self.template_kwargs), **kw)

    # --- scoring -----------------------------------------------------------------------------------

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        """``samples`` ``(B,3,H,W)`` / ``(B,F,3,H,W)`` in [0, 1] → ``{name: (B,)}`` float32 + ``valid`` ``(B,)``."""
        self._check(samples, prompts, metadata)
        n = samples.shape[0]
        finite = torch.isfinite(samples.detach()).flatten(1).all(1)
        scores = torch.full((n,), float("nan"))
        info: list[dict[str, Any]] = [{"mode": self.mode} for _ in range(n)]
        todo = [i for i in range(n) if finite[i]]
        for i in range(n):
            if not finite[i]:
                info[i]["reason"] = "sample has NaN/inf values"
        media = {i: self._media(samples[i]) for i in todo}
        if self.mode == "trm_edit":  # the authors' order: the source image, then the edited one
            for i in todo:
                source = {"type": "image", "image": to_pil(load_input_image(metadata[i]["image"]))}
                media[i] = (media[i][0], [source, *media[i][1]])
        judge = getattr(self, f"_score_{self.mode}")
        judge(todo, media, prompts, scores, info)
        valid = torch.isfinite(scores)
        self.stats["samples"] += n
        self.stats["invalid"] += int((~valid).sum())
        if not valid.all():
            reasons = Counter(str(x.get("reason", ""))[:100] for x, ok in zip(info, valid.tolist()) if not ok)
            log.warning("%s: %d/%d samples invalid (%s)", self.name, int((~valid).sum()), n,
                        "; ".join(f"{c}x {r}" for r, c in reasons.most_common(3)))
        return RewardOutput({self.name: scores.to(samples.device)}, valid=valid.to(samples.device), info=info)

    def _failed(self, c: Completion, info: dict[str, Any]) -> bool:
        if c.error is not None:
            info["reason"] = f"judge call failed: {c.error}"
            self.stats["call_failures"] += 1
            return True
        info["reply"] = (c.text or "")[:300]
        return False

    def _choice(self, todo: list[int], requests: list[ChatRequest], choices: list[str],
                info: list[dict[str, Any]]) -> list[list[float] | None]:
        out: list[list[float] | None] = []
        for i, c in zip(todo, self.backend.complete(requests)):
            probs = None
            if not self._failed(c, info[i]):
                if c.top_logprobs:
                    probs, mass, reason = choice_probs(c.top_logprobs, c.tokens, choices)
                    info[i]["choice_mass"] = mass
                else:  # a server without logprobs: read the generated text instead
                    probs, reason = choice_from_text(c.text, choices)
                if probs is None:
                    info[i]["reason"] = f"not a score: {reason}"
                    self.stats["parse_failures"] += 1
            out.append(probs)
        return out

    def _score_weighted(self, todo, media, prompts, scores, info) -> None:
        requests = [self._weighted_request(media[i], prompts[i]) for i in todo]
        for i, probs in zip(todo, self._choice(todo, requests, [str(k) for k in range(1, self.K + 1)], info)):
            if probs is not None:
                info[i]["probs"] = probs
                scores[i] = weighted_score(probs)

    def _weighted_request(self, media: tuple[str, list], prompt: str) -> ChatRequest:
        kind, parts = media
        text = self.question.format(prompt=prompt, media=kind, K=self.K)
        # two positions: a whitespace token may come before the digit (see choice_probs)
        return self._request(parts, text, self.prefix.format(media=kind), max_tokens=2, temperature=0.0,
                             top_logprobs=self.top_logprobs)

    def _score_yesno(self, todo, media, prompts, scores, info) -> None:
        requests = [self._weighted_request(media[i], prompts[i]) for i in todo]
        for i, probs in zip(todo, self._choice(todo, requests, ["yes", "no"], info)):
            if probs is not None:
                info[i]["probs"] = probs
                scores[i] = probs[0]

    def _score_text(self, todo, media, prompts, scores, info) -> None:
        requests = []
        for i in todo:
            kind, parts = media[i]
            requests.append(self._request(parts, self.question.format(prompt=prompts[i], media=kind, K=self.K),
                                          self.prefix.format(media=kind), max_tokens=self.max_tokens,
                                          temperature=self.temperature))
        for i, c in zip(todo, self.backend.complete(requests)):
            if self._failed(c, info[i]):
                continue
            parsed = parse_score(self.prefix + (c.text or ""), self.labels, (1, self.K))
            if parsed.ok:
                scores[i], info[i]["values"] = parsed.score, parsed.values
            else:
                info[i]["reason"] = f"not a score: {parsed.reason}"
                self.stats["parse_failures"] += 1

    # --- rubric (TRM) ------------------------------------------------------------------------------

    def rubric_for(self, prompts: list[str], kinds: list[str]) -> list[list[Criterion]]:
        """Rubrics for ``prompts``: one judge call per prompt not yet cached (LRU of ``rubric_cache_size``)."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.rubrics))
        kind_of = dict(zip(prompts, kinds))
        if missing:
            requests = [self._request([], self.question.format(prompt=p, media=kind_of[p], K=self.K), "",
                                      max_tokens=self.rubric_tokens, temperature=self.temperature)
                        for p in missing]
            self.stats["rubric_calls"] += len(missing)
            for p, c in zip(missing, self.backend.complete(requests)):
                rubric, reason = parse_rubric(c.text) if c.error is None else (None, c.error)
                if rubric is None:
                    # the same fallback for the whole group keeps its members comparable
                    self.stats["rubric_failures"] += 1
                    log.warning("%s: rubric for %r unreadable (%s); using the fallback rubric", self.name, p,
                                reason[:120])
                    rubric = FALLBACK_RUBRIC
                self.rubrics[p] = rubric
                while len(self.rubrics) > self.rubric_cache_size:
                    self.rubrics.popitem(last=False)
        for p in prompts:
            self.rubrics.move_to_end(p)
        return [self.rubrics[p] for p in prompts]

    def _judged_on_rubrics(self, todo, media, prompts, info, template: str, tokens_per_criterion: int):
        """``(i, rubric, completion)`` for each sample: the prompt's cached rubric, then one judge call on
        ``QUESTIONS[template]`` listing its criteria (failed calls already marked in ``info``)."""
        rubrics = self.rubric_for([prompts[i] for i in todo], [media[i][0] for i in todo])
        requests = []
        for i, rubric in zip(todo, rubrics):
            kind, parts = media[i]
            lines = "\n".join(f"- {c.name} (weight {c.weight:.2f}): {c.description}" for c in rubric)
            text = QUESTIONS[template].format(prompt=prompts[i], media=kind, criteria=lines)
            requests.append(self._request(parts, text, "", temperature=self.temperature,
                                          max_tokens=max(self.max_tokens, tokens_per_criterion * len(rubric))))
        for i, rubric, c in zip(todo, rubrics, self.backend.complete(requests)):
            info[i]["rubric"] = [c_.__dict__ for c_ in rubric]
            if not self._failed(c, info[i]):
                yield i, rubric, c

    def _score_rubric(self, todo, media, prompts, scores, info) -> None:
        for i, rubric, c in self._judged_on_rubrics(todo, media, prompts, info, "criteria", 16):
            parsed = parse_score(c.text, [c_.name for c_ in rubric], (0, 10), require_all=True)
            if parsed.ok:
                info[i]["values"] = parsed.values
                scores[i] = rubric_reward(rubric, parsed.values)
            else:
                info[i]["reason"] = f"not a score: {parsed.reason}"
                self.stats["parse_failures"] += 1

    def _score_think(self, todo, media, prompts, scores, info) -> None:
        for i, _, c in self._judged_on_rubrics(todo, media, prompts, info, "assess", 48):
            parsed = parse_thinking(c.text)
            if parsed.ok:
                info[i]["assessment"], info[i]["verdict"] = parsed.assessment[:300], parsed.score
                scores[i] = parsed.score / 10.0
            else:
                info[i]["reason"] = f"not a score: {parsed.reason}"
                self.stats["parse_failures"] += 1

    # --- the Thinking Reward Model's released protocol ----------------------------------------------

    def _score_trm(self, todo, media, prompts, scores, info) -> None:
        system, user = TRM_MODES[self.mode]
        requests = [self._request(media[i][1], user.format(instruction=prompts[i]), "",
                                  system=system, max_tokens=self.max_tokens, temperature=self.temperature)
                    for i in todo]
        for i, c in zip(todo, self.backend.complete(requests)):
            if self._failed(c, info[i]):
                continue
            parsed = parse_checklist(c.text)
            if parsed.ok:
                info[i]["final_score"], info[i]["score_reason"] = parsed.score, str(parsed.data.get("score_reason", ""))
                scores[i] = parsed.score / 10.0
            else:
                info[i]["reason"] = f"not a score: {parsed.reason}"
                self.stats["parse_failures"] += 1

    # the edit protocol differs only in its prompts and in the source image before the edit (see __call__)
    _score_trm_edit = _score_trm

    # --- pairwise ----------------------------------------------------------------------------------

    def _score_pairwise(self, todo, media, prompts, scores, info) -> None:
        groups: dict[str, list[int]] = {}
        for i in todo:
            groups.setdefault(prompts[i], []).append(i)
        pairs = [(a, b) for g in groups.values() for a in g for b in g if a != b]  # both orders: no position bias
        requests = []
        for a, b in pairs:
            kind = media[a][0]
            text = self.question.format(prompt=prompts[a], media=kind, K=self.K)
            parts = ([{"type": "text", "text": f"{kind.capitalize()} 1:"}] + media[a][1]
                     + [{"type": "text", "text": f"{kind.capitalize()} 2:"}] + media[b][1])
            requests.append(self._request(parts, text, self.prefix.format(media=kind), max_tokens=2,
                                          temperature=0.0, top_logprobs=self.top_logprobs))
        scratch: list[dict[str, Any]] = [{} for _ in pairs]
        wins: dict[int, list[float]] = {i: [] for i in todo}
        for (a, b), probs, s in zip(pairs, self._choice(list(range(len(pairs))), requests, ["1", "2"], scratch),
                                    scratch):
            if probs is None:
                info[a].setdefault("reason", s.get("reason", "comparison failed"))
                continue
            wins[a].append(probs[0])
            wins[b].append(probs[1])
        for i in todo:
            if len(groups[prompts[i]]) < 2:
                info[i]["reason"] = "pairwise mode needs at least 2 samples per prompt"
            elif len(wins[i]) == 2 * (len(groups[prompts[i]]) - 1):  # every comparison of i was read
                scores[i] = sum(wins[i]) / len(wins[i])
                info[i].pop("reason", None)
            else:
                info[i].setdefault("reason", "a comparison failed")


@register("vlm_judge")
class LocalVLMJudge(VLMJudge):
    """A judge running in this process: ``model`` is a local transformers VLM folder (Qwen2.5-VL,
    Qwen3-VL, ...); ``device``, ``dtype`` (fp32/bf16/fp16) and ``batch_size`` (requests per forward)
    as for the other rewards; the judge options as :class:`VLMJudge`."""

    name = "vlm_judge"

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "fp32", batch_size: int = 8,
                 **options: Any):
        from rewards.vlm_backend import LocalVLM

        backend = LocalVLM.shared(model, device=device, dtype=dtype, batch_size=batch_size)
        super().__init__(backend, **options)

    @classmethod
    def planned_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of the judge's model in ``dtype`` where ``device`` puts it on the accelerator (the default,
        ``cpu``, keeps it off), from its folder's config on the meta device; any VLM may be named, so a folder
        that does not exist is not sized."""
        from rewards.vlm_backend import LocalVLM

        if not on_accelerator(option(cls, options, "device")):
            return 0
        folder = existing(options.get("model"))
        if folder is None:
            raise missing("model", options.get("model"))
        return LocalVLM.planned_bytes(folder, option(cls, options, "dtype"))


@register("vlm_judge_http")
class HTTPVLMJudge(VLMJudge):
    """A judge behind an OpenAI-compatible server (vLLM, SGLang, ``flowalign serve-judge``).

    ``url`` (e.g. ``http://127.0.0.1:8000/v1``), ``model`` (the served name; None: the first of
    ``/v1/models``), ``api_key``, ``timeout`` (seconds per attempt), ``retries``, ``backoff`` (seconds,
    doubled per retry), ``concurrency`` (requests in flight); the judge options as :class:`VLMJudge`.
    """

    name = "vlm_judge_http"

    def __init__(self, url: str, model: str | None = None, *, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, concurrency: int = 8, **options: Any):
        from rewards.vlm_http import OpenAIChatClient

        client = OpenAIChatClient(url, model, api_key=api_key, timeout=timeout, retries=retries, backoff=backoff,
                                  concurrency=concurrency)
        super().__init__(client, **options)

    #: the model runs behind the server: nothing on this process's device
    planned_bytes = staticmethod(holds_nothing)
