"""Which tokens of which sequences run in the next step.

Policy, in order, within a per-step token budget:
1. decode-first: every running sequence that has finished its prompt gets its next token;
2. chunked prefill: sequences still reading their prompt get the budget that is left;
   waiting sequences join them when the engine opens admission, up to `max_running`. Prefill is
   ordered by prompt tokens left to compute (shortest first; a cached prefix does not count),
   then age; preempted sequences go first.
   A request that arrives after others (later than the batching window) gets its first token in
   a step without their prompt chunks (the step that reads the rest of its prompt): it waits for
   the step in flight and a short step, not for another full step of someone else's prompt.
   Requests that arrived together (a burst) are batched as usual. A prompt gives way at most
   every other step, so a stream of short newcomers cannot starve it.
3. with `decode_defer_steps` N > 0, decodes give way to prompts: while a prompt waits to be read
   (a running sequence mid-prompt, or a waiting one that admission would take), a step carries
   prompt chunks only, for at most N steps in a row; then one step decodes everyone (1. and 2.).
   A burst's prompts are then read before its decodes start, as vLLM does with its large steps:
   a decode riding in a prompt step pays for the output head and a row of every product that the
   decode-only steps at the end of a burst run almost free. Never when the free blocks could not
   then also hold every decode's next token (the deferral must not cause a preemption), and
   never into an empty step.
4. with `saturated_tokens_per_step` S > 0, the budget is S instead while the engine holds at
   least `max_running` requests (running or waiting): saturated, it makes every request wait for
   the batch as a whole, and larger steps read a backlog's prompts with fewer decodes riding along.
   Below that, a newcomer's first token waits behind the smaller step in flight.
5. with a `draft` proposer (speculative decoding), a step of decodes alone shares its budget out
   as draft tokens: each decode may carry guesses after its next token (`Chunk.draft`), an equal
   share of `draft_step_tokens` less the decodes (0: each in turn what the budget has left),
   never more than the free blocks hold. Never beside prompt chunks: a step that reads a prompt
   is bound by compute, where a guess costs what a prompt token costs, while a step of decodes
   alone is bound by reading the weights, and its extra rows cost far less than steps of their
   own (equal shares: fewer guesses each in a full batch, measured slower end to end on the CPU).
When the block pool cannot hold a decode, the youngest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later, once all of it fits
the free blocks (its generated tokens are kept, so its output does not change; a pruned sequence
is recomputed in full and pruned again). A joining sequence first adopts the cached blocks of its
longest known prefix (see `BlockManager.adopt_prefix`) and prefills only the rest.
Bookkeeping over `BlockManager`, no tensors. What KV compression quantises or drops is
`kv_policy`'s decision; the scheduler only keeps a pruned prompt's observation window whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int
    max_tokens_per_step: int
    prune_window: int = 0  # with KV pruning: the observation window every final prompt chunk holds
    together_s: float = 0.0  # requests arriving within this of each other form one batch (the window)
    decode_defer_steps: int = 0  # steps in a row that decodes may give way to prompts (3. above)
    saturated_tokens_per_step: int = 0  # the budget while saturated (4. above); 0: max_tokens_per_step
    draft_step_tokens: int = 0  # most tokens a step of decodes alone carries with drafts (5.); 0: budget

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_tokens_per_step < self.max_running:
            raise ValueError(f"need max_running >= 1 and a token budget >= it: {self}")


# A decode's draft tokens, given the sequence and how many the step has room for (none: no guess)
Drafter = Callable[[Sequence, int], tuple[int, ...]]


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first token index (== seq.num_computed when scheduled)
    num_tokens: int
    draft: tuple[int, ...] = ()  # guessed tokens run after the chunk's own, to be verified (5. above)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so its last logits give the next token."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, draft: Drafter | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.draft = draft
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.num_preemptions = 0
        self._num_plans = 0
        self._decodes_deferred = 0  # steps in a row whose decodes gave way to prompts

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes the sequence out (finished or cancelled) and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = Status.FINISHED

    def computed(self, chunk: Chunk) -> None:
        """Records that the chunk's tokens are now in the cache (their blocks become reusable)."""
        self._computed(chunk.seq, chunk.start + chunk.num_tokens)

    def accepted(self, seq: Sequence) -> None:
        """Records that one more of the sequence's draft tokens proved right: its keys and values,
        computed with the draft, are in the cache (the token itself is already appended)."""
        self._computed(seq, seq.num_computed + 1)

    def release_drafts(self, seq: Sequence) -> None:
        """Gives back the blocks beyond the sequence's next token, which held only rejected drafts."""
        if seq.status is Status.RUNNING:
            self.blocks.truncate(seq.seq_id, seq.num_cached + 1)

    def _computed(self, seq: Sequence, num_computed: int) -> None:
        seq.num_computed = num_computed
        if not seq.num_dropped:
            self.blocks.register(seq.seq_id, seq.token_ids, seq.num_computed)

    def schedule(self, admit: bool) -> list[Chunk]:
        while True:
            plan = self._plan(admit)
            if plan or not self.running:
                return plan
            # Nothing fits although sequences run (all prefilling, pool full): make room.
            self._preempt(self.running[-1])

    @property
    def budget(self) -> int:
        """Tokens the next step may carry: `saturated_tokens_per_step` (when set and larger) while
        at least `max_running` requests are running or waiting, else `max_tokens_per_step`."""
        config = self.config
        saturated = len(self.running) + len(self.waiting) >= config.max_running
        if saturated and config.saturated_tokens_per_step > config.max_tokens_per_step:
            return config.saturated_tokens_per_step
        return config.max_tokens_per_step

    def _plan(self, admit: bool) -> list[Chunk]:
        self._num_plans += 1
        budget = self.budget
        if self._decodes_deferred < self.config.decode_defer_steps and self._may_defer_decodes(admit, budget):
            plan = self._plan_prompts(admit, budget, [])
            if plan:
                self._decodes_deferred += 1
                return plan
        self._decodes_deferred = 0
        plan = self._plan_decodes()
        plan = self._plan_prompts(admit, budget - len(plan), plan)
        return self._with_drafts(plan, budget - sum(c.num_tokens for c in plan))

    def _may_defer_decodes(self, admit: bool, budget: int) -> bool:
        """Whether a prompt waits to be read beside running decodes, and the pool would still hold
        every decode's next token after a full step of prompt chunks (each chunk may start a block
        of its own: at most `max_running` more than the budget's)."""
        decoding = sum(1 for s in self.running if s.is_decoding)
        if not decoding:
            return False
        reading = any(not s.is_decoding for s in self.running) or (
            admit and bool(self.waiting) and len(self.running) < self.config.max_running
        )
        needed = self.blocks.blocks_for(budget) + self.config.max_running + decoding
        return reading and self.blocks.num_free >= needed

    def _plan_decodes(self) -> list[Chunk]:
        plan: list[Chunk] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not seq.is_decoding:
                continue
            while not self.blocks.can_allocate(seq.seq_id, seq.num_cached + 1):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is Status.RUNNING:
                plan.append(self._take(seq, 1))
        return plan

    def _with_drafts(self, plan: list[Chunk], room: int) -> list[Chunk]:
        """A plan of decodes alone with its room shared out as draft tokens: equal shares of
        `draft_step_tokens` less the decodes, or (0) decode by decode what the budget has left (a
        draft never takes a block another sequence would need this step: only free ones)."""
        if self.draft is None or not plan or any(c.num_tokens > 1 or not c.seq.is_decoding for c in plan):
            return plan
        share = room
        if self.config.draft_step_tokens:
            room = min(room, self.config.draft_step_tokens - len(plan))
            share = room // len(plan)
        for i, chunk in enumerate(plan):
            if room <= 0 or share <= 0:
                break
            seq = chunk.seq
            draft = self.draft(seq, min(share, room))[:room]
            if not draft or not self.blocks.can_allocate(seq.seq_id, seq.num_cached + 1 + len(draft)):
                continue
            self.blocks.allocate(seq.seq_id, seq.num_cached + 1 + len(draft))
            plan[i] = Chunk(seq, chunk.start, 1, draft)
            room -= len(draft)
        return plan

    def _plan_prompts(self, admit: bool, budget: int, plan: list[Chunk]) -> list[Chunk]:
        # Prefill: running prompts and (when admission is open) waiting ones share what is left,
        # shortest remaining prompt first (then oldest). Similar lengths prefill together, and a
        # short newcomer is not queued behind a 2,000-character document.
        planned = {id(c.seq) for c in plan}
        candidates = [s for s in self.running if id(s) not in planned and not s.is_decoding]
        if admit:
            candidates += list(self.waiting)
        candidates.sort(key=lambda s: (s.num_preemptions == 0, self._to_compute(s), s.request.arrived_at))
        # A request that arrived after other prompts gets its first token in a short step: their
        # chunks wait (requests that arrived together, within the window, are batched as usual).
        newcomer: float | None = None  # the latest arrival among the chunks that finish a prompt
        for seq in candidates:
            if budget <= 0:
                break
            joining = seq.status is Status.WAITING
            if joining and len(self.running) >= self.config.max_running:
                continue
            if joining and seq.num_preemptions and self._too_big_to_resume(seq):
                continue  # a preempted sequence comes back only when all of it fits: no thrashing
            n = min(seq.num_pending, budget, self._room(seq))
            if n <= 0:
                break
            if joining:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                seq.num_computed = self.blocks.adopt_prefix(seq.seq_id, seq.token_ids, seq.prefix_keys)
                n = min(seq.num_pending, budget, self._room(seq))
                if n <= 0:
                    break
            if (
                self.config.prune_window
                and not seq.pruned
                and 0 < seq.num_pending - n < self.config.prune_window
            ):
                n = seq.num_pending - self.config.prune_window  # the final chunk must hold the window
                if n <= 0:
                    continue
            if (
                newcomer is not None
                and seq.request.arrived_at < newcomer - self.config.together_s
                and seq.deferred_at != self._num_plans - 1
            ):
                seq.deferred_at = self._num_plans  # its chunk waits one step, never two in a row
                continue
            if n == seq.num_pending:
                newcomer = max(newcomer or 0.0, seq.request.arrived_at)
            plan.append(self._take(seq, n))
            budget -= n
        return plan

    def _too_big_to_resume(self, seq: Sequence) -> bool:
        """Whether its tokens need more blocks than are free (never more than the whole pool:
        with nothing running, any sequence the engine accepted fits)."""
        needed = min(self.blocks.blocks_for(seq.num_pending), self.blocks.num_blocks)
        return needed > self.blocks.num_free

    def _to_compute(self, seq: Sequence) -> int:
        """Prompt tokens left to run; a waiting sequence's cached prefix does not count."""
        if seq.status is Status.WAITING:
            return seq.num_pending - self.blocks.cached_prefix(seq.token_ids, seq.prefix_keys)
        return seq.num_pending

    def _take(self, seq: Sequence, n: int) -> Chunk:
        self.blocks.allocate(seq.seq_id, seq.num_cached + n)
        return Chunk(seq, seq.num_computed, n)

    def _room(self, seq: Sequence) -> int:
        """Tokens the sequence can still add with its own blocks plus the free pool."""
        capacity = (len(self.blocks.table(seq.seq_id)) + self.blocks.num_free) * self.blocks.block_size
        return capacity - seq.num_cached

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.num_settled_blocks = 0
        seq.num_dropped = 0
        seq.pruned = False
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
