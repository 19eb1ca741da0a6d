"""agent/codemods/commands/per_rank_batch_size.py (upstream's common issue: the global batch size read per rank):
reads use the per-rank size."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.per_rank_batch_size import PerRankBatchSizeCommand


class TestPerRankBatchSizeCommand(CodemodTest):
    TRANSFORM = PerRankBatchSizeCommand

    def test_noop_other_batch_sizes(self) -> None:
        code = """
            bs = data_config.batch_size
            infer_config.scheduler_config.batch_size = 8
        """
        self.assertCodemod(code, code)

    def test_reads_use_the_per_rank_size(self) -> None:
        before = """
            bs = self.infer_config.scheduler_config.batch_size
        """
        after = """
            bs = self.infer_config.scheduler_config.batch_size_per_dp_rank
        """
        self.assertCodemod(before, after)
