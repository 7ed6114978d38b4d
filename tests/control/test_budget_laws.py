"""The budget laws beside the paper's: a fixed token budget (Quest), top-p of the measured mass
(Twilight, in test_reused_mass.py), the entropy of the measured mass (EntropyInfer's signal), and
the checks that name the field."""

import re

import pytest
import torch

from etinfer.control.block_budgets import PruningConfig, check_context, plan_budget
from etinfer.control.block_selection import EntropicSelector
from tests.control.test_pruning import DIM, HEADS
from tests.control.test_reused_mass import REUSED, step


@pytest.mark.parametrize(("context", "entropy", "kept"), [(8192, 0.1, 64), (8192, 6.0, 64)])
def test_the_fixed_law_keeps_its_tokens_whatever_the_entropy(context, entropy, kept):
    config = PruningConfig(budget_law="fixed", token_budget=1024)
    assert plan_budget(entropy, context, None, False, config, 16) == kept


def test_the_fixed_law_reads_a_short_context_whole_and_never_below_min_blocks():
    config = PruningConfig(budget_law="fixed", token_budget=40, min_blocks=8, min_context=0)
    assert plan_budget(1.0, 100, None, False, config, 16) == 7  # all 7 blocks
    assert plan_budget(1.0, 4000, None, False, config, 16) == 8  # 3 blocks' worth, min 8


def test_a_token_budget_the_context_cannot_pass_is_refused_naming_the_field():
    config = PruningConfig(budget_law="fixed", token_budget=8192)
    with pytest.raises(ValueError, match="token_budget must be below max_model_len 8192"):
        check_context(config, 8192)
    check_context(config, 8193)
    check_context(PruningConfig(token_budget=8192), 8192)  # another law ignores it
    with pytest.raises(ValueError, match="token_budget"):
        PruningConfig(token_budget=0)


@pytest.mark.parametrize("law", ["attention-entropy", "entropy+top-p"])
def test_laws_that_count_measured_mass_need_it(law):
    with pytest.raises(ValueError, match=re.escape(f"budget_law '{law}'") + ".*reused-mass"):
        PruningConfig(scorer="bound", budget_law=law)


def test_the_attention_entropy_law_keeps_few_blocks_where_the_mass_is_sharp():
    cache, tables, blocks = step([120, 120], [20, 20])
    config = PruningConfig(
        **REUSED,
        selection_layers=(1,),
        budget_law="attention-entropy",
        budget_low=0.1,
        budget_high=0.5,
        min_blocks=3,
    )
    selector = EntropicSelector(config)
    query = torch.zeros(2, HEADS, DIM)
    selecting = cache.summaries(0)
    selector.select(1, query, blocks, selecting)
    selecting.mass.zero_()
    first, second = tables[0].tolist(), tables[1].tolist()
    selecting.mass[0, first[5]] = 1.0  # row 0: one block carries all of the mass
    for block in second:  # row 1: every block alike
        selecting.mass[:, block] = 0.025
    kept = selector.select(2, query, blocks, cache.summaries(0)).mask.sum(-1)
    # 28 candidates besides the sink and the recent block: a tenth (3) when sharp, half (14)
    # when spread, each with the two forced blocks
    assert kept[0].tolist() == [5, 5]
    assert kept[1].tolist() == [16, 16]
