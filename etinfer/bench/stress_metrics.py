"""The stress test's figures: what each stressed run changed, against the layer-off engine and
against its own arm unstressed.

Scheduling decisions are counted by a shadow of the scheduling law (``DecisionShadow``): the law's
decisions at a step are two orders, of the running sequences (who gets the step's token budget
first) and of the waiting ones (who is admitted first); at every step with two or more sequences
to order, the shadow orders the same sequences twice, once with the record the law really read
and once with each sequence's expected entropy reduction recomputed from the model's own exact,
uncalibrated entropy (the signal without stress, estimator or calibration). A decision changed
when either order differs. Counting within one run avoids comparing two runs whose batches have
drifted apart for other reasons (timing, sampled tokens). The orders are taken after the step ran
(observers see it then), so the sequences' lengths have moved by the step's tokens: both orders
see the same lengths, and only the entropy term differs.
"""

from __future__ import annotations

from etinfer.bench.ablation_metrics import _answers_rouge, spread
from etinfer.control.entropy_profile import EntropyProfile
from etinfer.control.record import ControlRecord
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.observer import StepRecord

# The figures a stressed run is judged by, and whether lower is better (None: neither).
FIGURES = {
    "kv_read_share": True,  # blocks decode attention read, share of the context's
    "passkey_accuracy": False,
    "rouge_l_baseline": False,  # greedy answers against the layer-off engine's
    "rouge_l_human": False,
    "decisions_changed": True,
    "sampled_entropy_sd": None,  # spread of the entropy sampled text was drawn at
    "sampled_temperature_mean": None,
    "throughput": False,
}


class DecisionShadow:
    """Counts the steps whose scheduling orders the stress (or estimator) changed."""

    def __init__(self, engine: LLMEngine) -> None:
        policy = engine.scheduler.policy
        # A second instance: ordering moves a policy's state (its step, aging horizon).
        self.policy = type(policy)(policy.config, chunk_tokens=policy.chunk_tokens)
        self.profiles: dict[str, EntropyProfile] = {}
        self.decisions = 0
        self.changed = 0
        engine.add_observer(self)

    def __call__(self, step: StepRecord) -> None:
        record = step.control
        if len(record.running) > 1 or len(record.waiting) > 1:
            entries = {
                seq: entry._replace(
                    expected_reduction=(
                        p := self.profiles.get(seq.request_id, EntropyProfile())
                    ).expected_reduction,
                    prior_weight=p.prior_weight,
                )
                for seq, entry in record.seqs.items()
            }
            shadow = ControlRecord(record.step, record.running, record.waiting, entries)
            self.decisions += 1
            self.changed += self._orders(record) != self._orders(shadow)
        if step.measured is not None:
            for row, entropy in zip(step.sampled, step.measured.entropies, strict=True):
                profile = self.profiles.setdefault(step.request_ids[row], EntropyProfile())
                profile.update(entropy)

    def _orders(self, record: ControlRecord) -> tuple[list[str], list[str]]:
        self.policy.begin_step(record)
        return tuple(
            [s.request_id for s in self.policy.order(group)]
            for group in (record.running, record.waiting)
        )

    @property
    def share_changed(self) -> float:
        return self.changed / self.decisions if self.decisions else 0.0


def compare(records: list[dict]) -> None:
    """Into each record's figures: ROUGE-L against the layer-off engine's greedy answers of the
    same repeat, and the ratios to its own arm unstressed (``*_vs_unstressed``): the efficiency
    kept is the share of the unstressed arm's saving in blocks read that the stressed run keeps
    (above 1: it prunes harder)."""
    off = {r["repeat"]: r for r in records if r["arm"] == "layers off"}
    plain = {(r["arm"], r["repeat"]): r for r in records if r["stress"] == "none"}
    for record in records:
        figures = record["figures"]
        figures["rouge_l_baseline"] = _answers_rouge(record, off[record["repeat"]])
        own = plain.get((record["arm"], record["repeat"]))
        if own is None:
            continue
        base = own["figures"]
        saving = 1 - base["kv_read_share"]
        figures["efficiency_kept"] = (1 - figures["kv_read_share"]) / saving if saving else None
        figures["throughput_vs_unstressed"] = figures["throughput"] / base["throughput"]
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
