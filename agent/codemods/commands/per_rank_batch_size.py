"""Per-rank buffers sized by the per-rank batch (upstream's common issue 5: sized by the global
scheduler_config.batch_size, aclnnMoeInitRouting reports `row_idx shape mismatch` in graph mode)."""

from __future__ import annotations

import libcst as cst

from agent.codemods._toolkit import Command, ends_with


class PerRankBatchSizeCommand(Command):
    DESCRIPTION = ("Size per-rank buffers by scheduler_config.batch_size_per_dp_rank, not the global "
                   "scheduler_config.batch_size.")

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.Attribute:
        if updated_node.attr.value == "batch_size" and ends_with(updated_node.value, "scheduler_config"):
            return updated_node.with_changes(attr=cst.Name("batch_size_per_dp_rank"))
        return updated_node

    def leave_AssignTarget(self, original_node: cst.AssignTarget, updated_node: cst.AssignTarget):
        return updated_node.with_changes(target=original_node.target)    # a write of batch_size stays one
