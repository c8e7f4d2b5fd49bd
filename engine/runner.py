"""Runs one engine step: a single forward over the packed tokens of every scheduled chunk.

Owns every tensor of a step. The step's layout (`StepBatch`) travels as a forward keyword to the
registered paged attention function; `logits_to_keep` selects the last token of each chunk that
samples, and each of its draft tokens (speculative decoding: verified here against the greedy
choice). Sampling (greedy or temperature/top-p with a per-request seed) runs on fp32 logits after
the grammar mask. A request's `exact_ids` get their logits recomputed in fp32 from the head's input
(the final hidden state) where the head is a plain product (`exact_head`). Runs on the engine's
worker thread; returns tokens, mutates no scheduler state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.attention import SeqSlice, StepBatch, group_decodes, in_place_decodes
from engine.block_manager import BlockManager
from engine.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from engine.kv_cache import KVCache, slots_of
from engine.kv_policy import Moves
from engine.loader import LoadedModel
from engine.request import HiddenObserver
from engine.scheduler import Chunk
from engine.sequence import Sequence


@dataclass(frozen=True)
class StepOutput:
    # per chunk: the tokens it yields if it reached its sequence's end (else none): the sampled
    # token, or with a draft, the drafts the model agreed with and then the model's own next token
    tokens: list[tuple[int, ...]]
    scores: dict[int, torch.Tensor]  # seq id -> attention its cached tokens received (to prune)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cache: KVCache, blocks: BlockManager, observe: int = 0) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.cache = cache
        self.block_size = cache.block_size
        self.blocks = blocks  # read-only here: the scheduler owns allocation
        self.observe = observe  # attention pruning: the observation window to score with (0: off)
        self.vocab_size = int(self.model.config.vocab_size)
        self.layers: Seq[torch.nn.Module] = self.model.get_decoder().layers
        self.num_layers = len(self.layers)
        self.head = self.model.get_output_embeddings()
        self.exact = exact_head(self.model)
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # the engine thread and a preparing thread may race

    def grammar(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar is None:  # built on first use: indexing a 150k vocabulary takes a moment
                self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammar

    def grammar_ready(self, json_schema: str) -> bool:
        return self._grammar is not None and self._grammar.is_compiled(json_schema)

    @torch.inference_mode()
    def step(self, plan: Seq[Chunk], moves: Moves | None = None) -> StepOutput:
        """The sampled token of each chunk that reaches its sequence's end (None for the others),
        and the attention scores of the sequences that asked to be scored."""
        scores: dict[int, torch.Tensor] = {}
        logits = self.forward(plan, moves, scores)
        tokens = iter(self._sample(logits, [c for c in plan if c.samples]))
        return StepOutput([next(tokens) if c.samples else () for c in plan], scores)

    @torch.inference_mode()
    def forward(
        self, plan: Seq[Chunk], moves: Moves | None = None, scores: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """fp32 next-token logits (S, V): one row per chunk that reaches its sequence's end, and
        one more per draft token of such a chunk (its rows in order).

        `moves` are applied first: pruned sequences' tokens copied into their compacted blocks,
        then blocks leaving the recent window quantised. The scheduler has already changed the
        block tables, and no block freed by that is reused before this step has run. Chunks
        whose sequence is to be pruned (`observe`) get their keys' scores in `scores` by seq id."""
        moves = moves or Moves()
        for copy in moves.copies:
            source, destination = (
                torch.tensor(slots, dtype=torch.long, device=self.device) for slots in copy
            )
            self.cache.keys[:, destination] = self.cache.keys[:, source]
            self.cache.values[:, destination] = self.cache.values[:, source]
        if moves.settle:
            pairs = torch.tensor(moves.settle, dtype=torch.long, device=self.device)  # (n, 2): hot, cold
            self.cache.settle(pairs[:, 0], pairs[:, 1])
        ids: list[int] = []
        positions: list[int] = []
        new_slots: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        last_rows: list[int] = []  # rows whose logits are kept
        tap_rows: list[int] = []  # per sampling chunk, the row of its own last token
        exact: list[tuple[int, tuple[int, ...]]] = []  # (logits row, token ids) recomputed in fp32
        step_scores: dict[int, torch.Tensor] = {}
        observed: dict[int, int] = {}  # first row of a chunk to score -> its sequence
        for chunk in plan:
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens + len(chunk.draft)  # drafts follow the chunk's tokens
            table = self.blocks.table(seq.seq_id)
            observe = self.observe if chunk.samples and not seq.pruned and chunk.num_tokens > 1 else 0
            slots, cold, cold_tokens = self.cache.locate(table, end - seq.num_dropped)
            cold = None if cold is None else cold.to(self.device)
            slots = slots.to(self.device)
            if chunk.draft:  # each token attends as a decode of its own, to the history up to itself
                for i in range(1 + len(chunk.draft)):
                    held = slots[: slots.shape[0] - len(chunk.draft) + i]
                    seqs.append(SeqSlice(len(ids) + i, 1, held, cold, cold_tokens))
            else:
                seqs.append(SeqSlice(len(ids), end - chunk.start, slots, cold, cold_tokens, observe))
            if observe:
                step_scores[len(ids)] = torch.zeros(end - seq.num_dropped, device=self.device)
                observed[len(ids)] = seq.seq_id
            ids += seq.token_ids[chunk.start : chunk.start + chunk.num_tokens] + list(chunk.draft)
            positions += range(chunk.start, end)
            new_slots.append(
                slots_of(table, end - seq.num_dropped, self.block_size, start=chunk.start - seq.num_dropped)
            )
            if chunk.samples:
                tap_rows.append(len(ids) - 1 - len(chunk.draft))
                if seq.request.params.exact_ids and self.exact is not None:
                    exact.append((len(last_rows), seq.request.params.exact_ids))
                last_rows += range(tap_rows[-1], len(ids))
        # Decodes without a sliding window share one padded attention call per layer.
        sliding = getattr(self.model.config, "sliding_window", None) and getattr(
            self.model.config, "use_sliding_window", False
        )
        decodes = [] if sliding else [s for s in seqs if s.q_len == 1]
        in_place, decodes = (None, decodes)
        if self.cache.kernel is not None:  # the kernel reads quantised blocks unless they are rotated
            reads_cold = self.cache.cold is not None and self.cache.cold.rotation is None
            in_place, decodes = in_place_decodes(decodes, reads_cold)
        batch = StepBatch(
            self.cache,
            torch.cat(new_slots).to(self.device),
            [s for s in seqs if s.q_len > 1 or sliding],
            group_decodes(decodes, self.cache.shape.num_kv_heads, self.block_size, self.device),
            step_scores,
            in_place,
        )
        sampling = [c.seq.request.hidden for c in plan if c.samples]
        hooks = _HiddenTaps(
            self.layers, [(row, h) for row, h in zip(tap_rows, sampling, strict=True) if h is not None]
        )
        heads: list[torch.Tensor] = []  # the head's input (1, S, H), when a row asks for exact logits
        tap_head = None
        if exact:
            tap_head = self.head.register_forward_hook(lambda _m, args, _o: heads.append(args[0]))
        try:
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),  # (1, T)
                position_ids=torch.tensor([positions], device=self.device),  # (1, T)
                use_cache=False,
                logits_to_keep=torch.tensor(last_rows, dtype=torch.long, device=self.device),
                step=batch,
            )
        finally:
            hooks.remove()
            if tap_head is not None:
                tap_head.remove()
        if scores is not None:
            scores.update({observed[start]: value.cpu() for start, value in step_scores.items()})
        logits: torch.Tensor = out.logits[0].float()  # (S, V): one row per sampling chunk
        if exact and self.exact is not None:
            weight, bias = self.exact
            for row, wanted in exact:
                index = torch.tensor(wanted, dtype=torch.long, device=weight.device)
                value = weight.index_select(0, index).float() @ heads[0][0, row].float().to(weight.device)
                if bias is not None:
                    value += bias.index_select(0, index).float()
                logits[row, index.to(logits.device)] = value.to(logits.device)
        return logits

    def _sample(self, logits: torch.Tensor, chunks: list[Chunk]) -> list[tuple[int, ...]]:
        """Per sampling chunk, its tokens: the sampled one, or after a draft, the drafts the
        greedy choice agrees with, each followed by the model's own choice after it."""
        logits = logits[:, : self.vocab_size]
        firsts = [0]  # each chunk's first row: its own last token's; then one per draft token
        for chunk in chunks:
            firsts.append(firsts[-1] + 1 + len(chunk.draft))
        for chunk, row in zip(chunks, firsts, strict=False):
            if chunk.seq.request.observer is not None:  # the model's own distribution, before any mask
                chunk.seq.request.observer(logits[row])
        constrained = [i for i, c in enumerate(chunks) if c.seq.request.params.json_schema is not None]
        if constrained:
            bitmask = allocate_bitmask(len(logits), self.vocab_size)
            masked: list[int] = []
            for i in constrained:
                masked += self._fill_masks(chunks[i], bitmask, firsts[i])
            apply_bitmask(logits, bitmask.to(logits.device), masked)
        chosen = logits.argmax(dim=-1).tolist()  # (rows,)
        out: list[tuple[int, ...]] = []
        for chunk, row in zip(chunks, firsts, strict=False):
            seq, params = chunk.seq, chunk.seq.request.params
            tokens = [int(chosen[row])]
            if params.forced_ids:
                tokens = [params.forced_ids[seq.num_output]]
            elif params.temperature > 0:
                tokens = [_sample_row(logits[row], params.temperature, params.top_p, _generator(seq))]
            for i, guess in enumerate(chunk.draft):  # drafts come only with greedy requests
                if guess != tokens[-1]:
                    break
                tokens.append(int(chosen[row + 1 + i]))
            if seq.matcher is not None:
                for n, token in enumerate(tokens):
                    seq.matcher.accept_token(token)
                    if seq.matcher.is_terminated():  # the sequence ends here: nothing after counts
                        del tokens[n + 1 :]
                        break
            out.append(tuple(tokens))
        return out

    def _fill_masks(self, chunk: Chunk, bitmask: torch.Tensor, row: int) -> list[int]:
        """Fills the grammar's masks of a constrained chunk's rows (from `row`); returns them. A
        draft's rows are masked as if the drafts before them were taken (the matcher accepts them
        for that, then rolls back); after a draft the grammar refuses, or one that ends it, no
        row is used."""
        seq = chunk.seq
        if seq.matcher is None:
            seq.matcher = self.grammar().matcher(seq.request.params.json_schema or "")
        seq.matcher.fill_next_token_bitmask(bitmask, row)
        rows, taken = [row], 0
        for guess in chunk.draft:
            if not seq.matcher.accept_token(guess):
                break
            taken += 1
            if seq.matcher.is_terminated():  # a stop token: the sequence would end there
                break
            seq.matcher.fill_next_token_bitmask(bitmask, row + taken)
            rows.append(row + taken)
        if taken:
            seq.matcher.rollback(taken)
        return rows


def exact_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The output head's weight and bias where its logits are its input times them, rounded to a
    narrower dtype than fp32, and nothing more: a plain `nn.Linear`, or a packed head that kept
    its plain rows (`engine.linear.PackedLinear`); None for an fp32 head (nothing is rounded), a
    quantised one, or a model that scales or caps its logits after the head."""
    from engine.linear import PackedLinear

    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    head = model.get_output_embeddings()  # type: ignore[operator]
    weight: torch.Tensor
    bias: torch.Tensor | None
    if type(head) is torch.nn.Linear:
        weight, bias = head.weight, head.bias
    elif isinstance(head, PackedLinear) and head.rows is not None:
        weight, bias = head.rows, head.bias
    else:
        return None
    return None if weight.dtype == torch.float32 else (weight, bias)


class _HiddenTaps:
    """For one forward: the hidden states some sampling rows asked for, handed to their observers
    as each tapped decoder layer finishes (a forward hook per depth asked, removed afterwards)."""

    def __init__(self, layers: Seq[torch.nn.Module], wanted: list[tuple[int, HiddenObserver]]) -> None:
        self.handles = []
        for depth in sorted({d for _, (d, _) in wanted}):
            taps = [(row, see) for row, (d, see) in wanted if d == depth]
            self.handles.append(layers[depth - 1].register_forward_hook(_tap(taps)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tap(taps: list[tuple[int, Callable[[torch.Tensor], None]]]) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (1, T, H)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"a decoder layer returned {type(hidden).__name__}, not its hidden states")
        for row, see in taps:
            see(hidden[0, row].float().cpu().clone())

    return hook


def _sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # (V,), where the generator is
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        sorted_probs[sorted_probs.cumsum(-1) - sorted_probs > top_p] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def _generator(seq: Sequence) -> torch.Generator:
    if seq.generator is None:
        seq.generator = torch.Generator()  # on the CPU: the probabilities are small, the seed portable
        if seq.request.params.seed is not None:
            seq.generator.manual_seed(seq.request.params.seed)
        else:
            seq.generator.seed()
    return seq.generator
