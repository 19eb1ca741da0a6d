"""No whitespace at the end of a line the codemods wrote (upstream's `trailing-whitespace` hook).

libcst writes an `EmptyLine()` inside a block with the block's indentation (its default
`indent=True`), so a blank line a command inserts before a method is "    \\n"; a comment or a line
end may also carry spaces before the newline. Applied last to every vendored file: blank lines lose
their indentation and whitespace, trailing whitespace before a newline (outside strings) goes.
"""

from __future__ import annotations

import libcst as cst

from agent.codemods._toolkit import Command


class BlankLineWhitespaceCommand(Command):
    DESCRIPTION = "Strip indentation from blank lines and whitespace before line ends."

    def leave_EmptyLine(self, original_node: cst.EmptyLine, updated_node: cst.EmptyLine) -> cst.EmptyLine:
        if updated_node.comment is None:
            if updated_node.indent or updated_node.whitespace.value:
                return updated_node.with_changes(indent=False, whitespace=cst.SimpleWhitespace(""))
            return updated_node
        value = updated_node.comment.value.rstrip()
        if value != updated_node.comment.value:
            return updated_node.with_changes(comment=cst.Comment(value))
        return updated_node

    def leave_TrailingWhitespace(self, original_node: cst.TrailingWhitespace,
                                 updated_node: cst.TrailingWhitespace) -> cst.TrailingWhitespace:
        changes = {}
        if updated_node.comment is None and updated_node.whitespace.value:
            changes["whitespace"] = cst.SimpleWhitespace("")
        elif updated_node.comment is not None and updated_node.comment.value != updated_node.comment.value.rstrip():
            changes["comment"] = cst.Comment(updated_node.comment.value.rstrip())
        return updated_node.with_changes(**changes) if changes else updated_node
