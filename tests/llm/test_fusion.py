"""What the engines compile runs one variant per kind of shape, whatever order the shapes come in: the numbers of
a run do not depend on the runs before it."""

import torch

from services.llm.fusion import compiled


def test_a_shape_runs_the_variant_it_ran_first():
    variants = []

    def rows(x, y):  # two inputs whose sizes are sometimes equal, as a step's rows and its sequences are
        return (x * 2).sum(0) + (y + 1).sum(0)

    fn = compiled(rows)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for a, b in [(5, 5), (5, 7), (5, 5), (3, 3), (6, 2)]:
        torch.testing.assert_close(fn(torch.ones(a, 4), torch.ones(b, 4)), rows(torch.ones(a, 4), torch.ones(b, 4)))
        variants.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert variants == [1] * 5  # equal sizes first made no variant that unequal ones then replace
