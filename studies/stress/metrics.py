"""The stress test's figures: what each stressed run changed, against the layer-off engine and
against its own arm unstressed.

Scheduling decisions are counted by a shadow of the scheduling law (``DecisionShadow``). It
stands in for the engine's policy and answers every question with the real policy's answer, and
each time the scheduler asks for an order of two or more sequences (the running ones, for the
step's token budget; the waiting ones, for admission) it also asks a twin of the law, whose
record carries each sequence's expected entropy reduction recomputed from the model's own
exact, uncalibrated entropy (the signal without stress, estimator or calibration). A decision
changed where the two orders differ. Both orders are taken at the moment the scheduler asks,
from the same sequences, so only the entropy term differs; counting within one run avoids
comparing two runs whose batches drift apart for other reasons (timing, sampled tokens). An
order can change without changing the batch (when the budget covers every running sequence):
the figure counts what the law decides, an upper bound on what the scheduler does with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from etinfer.control.entropy_profile import EntropyProfile
from etinfer.control.record import Controlled, ControlRecord
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.observer import StepRecord
from studies.ablation.metrics import answers_rouge, spread


class DecisionShadow:
    """Counts the scheduling orders the stress (or estimator) changed; see the module."""

    def __init__(self, engine: LLMEngine) -> None:
        self.policy = policy = engine.scheduler.policy
        # A second instance: ordering moves a policy's state (its step, aging horizon).
        self.twin = type(policy)(
            policy.config, chunk_tokens=policy.chunk_tokens, clock=policy.clock
        )
        self.profiles: dict[str, EntropyProfile] = {}
        self.decisions = 0
        self.changed = 0
        engine.scheduler.policy = self
        engine.add_observer(self)

    def begin_step(self, record: ControlRecord) -> None:
        self.policy.begin_step(record)
        entries = {
            seq: entry._replace(
                expected_reduction=(
                    p := self.profiles.get(seq.request_id, EntropyProfile())
                ).expected_reduction,
                prior_weight=p.prior_weight,
            )
            for seq, entry in record.seqs.items()
        }
        self.twin.begin_step(ControlRecord(record.step, record.running, record.waiting, entries))

    def order(self, seqs: Sequence[Controlled]) -> list[Controlled]:
        ordered = self.policy.order(seqs)
        if len(seqs) > 1:
            self.decisions += 1
            self.changed += ordered != self.twin.order(seqs)
        return ordered

    def victim(self, candidates: Sequence[Controlled]) -> Controlled:
        return self.policy.victim(candidates)

    def growth_reserve(self, seqs: Sequence[Controlled], block_size: int) -> int:
        return self.policy.growth_reserve(seqs, block_size)

    def __call__(self, step: StepRecord) -> None:
        """After each step: the model's entropies into the twin's profiles."""
        if step.measured is not None:
            for row, entropy in zip(step.sampled, step.measured.entropies, strict=True):
                profile = self.profiles.setdefault(step.request_ids[row], EntropyProfile())
                profile.update(entropy)

    @property
    def share_changed(self) -> float | None:
        return self.changed / self.decisions if self.decisions else None


def compare(records: list[dict]) -> None:
    """Into each record's figures: ROUGE-L against the layer-off engine's greedy answers of the
    same repeat; the throughput against the layer-off engine's; and the efficiency kept: the
    share of its own arm's unstressed saving in blocks read that the run keeps (above 1: it
    prunes harder)."""
    off = {r["repeat"]: r for r in records if r["arm"] == "layers off"}
    plain = {(r["arm"], r["repeat"]): r for r in records if r["stress"] == "none"}
    for record in records:
        figures = record["figures"]
        figures["rouge_l_baseline"] = answers_rouge(record, off[record["repeat"]])
        own = plain.get((record["arm"], record["repeat"]))
        if own is None:
            continue
        base = own["figures"]
        saving = 1 - base["kv_read_share"]
        figures["efficiency_kept"] = (1 - figures["kv_read_share"]) / saving if saving else None
        figures["throughput_vs_layers_off"] = (
            figures["throughput"] / off[record["repeat"]]["figures"]["throughput"]
        )


def summarize(records: list[dict]) -> dict:
    """Per (arm, stress) and figure: mean, sd, min, max over repeats."""
    summary: dict = {}
    for record in records:
        key = f"{record['arm']} | {record['stress']}"
        summary.setdefault(key, {"arm": record["arm"], "stress": record["stress"], "runs": []})
        summary[key]["runs"].append(record["figures"])
    for entry in summary.values():
        runs = entry.pop("runs")
        entry["figures"] = {
            name: spread(values)
            for name in runs[0]
            if (values := [r[name] for r in runs if r.get(name) is not None])
        }
    return summary
