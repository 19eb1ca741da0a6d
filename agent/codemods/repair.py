"""Codemods of the repair rules: each rewrites one thing in a recipe's Python files.

Vendoring codemods live in agent.codemods.vendor, device-portability ones in agent.codemods.device;
`rewrite_file` runs any of them on a recipe file, keeping its encoding, BOM and line endings.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.metadata import PositionProvider

from agent.codemods.vendor import _dotted, _insert_param, _param_names
from agent.codemods.device import transform

_BOM = "\ufeff"


def codemod(command: type[VisitorBasedCodemodCommand], **kwargs):
    """A command with its arguments bound, as `transform` and `rewrite_file` take it."""
    return partial(command, **kwargs) if kwargs else command


def rewrite_file(path: Path, commands, dry_run: bool = False, context: CodemodContext | None = None) -> bool:
    """Run codemods on one file, keeping its encoding, BOM, line endings and mode. True if it changed
    (or would: dry_run). A file that does not decode or parse is not touched."""
    try:
        text = path.read_bytes().decode("utf-8")
        bom = text.startswith(_BOM)
        source = text[1:] if bom else text
        new = transform(source, commands, context)
    except Exception:      # noqa: BLE001 - unparsable / undecodable: not ours to touch
        return False
    if new == source:
        return False
    if not dry_run:
        path.write_bytes(((_BOM if bom else "") + new).encode("utf-8"))
    return True


# ---- forward() without **kwargs -------------------------------------------------------------
class AddForwardKwargsCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Let one class's forward() accept (and ignore) extra keyword arguments: add **kwargs."

    def __init__(self, context: CodemodContext, class_name: str, method: str = "forward"):
        super().__init__(context)
        self.class_name, self.method = class_name, method
        self._depth = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._depth += 1
        return self._depth == 1 and node.name.value == self.class_name

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._depth -= 1
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # only the method's signature changes

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if updated_node.name.value != self.method or updated_node.params.star_kwarg is not None:
            return updated_node
        if not _param_names(updated_node.params)[:1] == ["self"]:
            return updated_node
        kwargs = cst.Param(name=cst.Name("kwargs"), star="**")
        return updated_node.with_changes(params=_insert_param(updated_node.params, "star_kwarg", kwargs))


# ---- from_pretrained of remote code without trust_remote_code -------------------------------
class TrustRemoteCodeCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Pass trust_remote_code=True to the from_pretrained(...) call on a given line."

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, context: CodemodContext, line: int):
        super().__init__(context)
        self.line = line
        self._target: cst.Call | None = None

    def visit_Call(self, node: cst.Call) -> None:
        if not m.matches(node.func, m.Attribute(attr=m.Name("from_pretrained"))):
            return
        pos = self.get_metadata(PositionProvider, node)
        if pos.start.line <= self.line <= pos.end.line:
            self._target = node       # visited outer -> inner: the innermost call wins

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if original_node is not self._target:
            return updated_node
        args = list(updated_node.args)
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == "trust_remote_code":
                args[i] = arg.with_changes(value=cst.Name("True"))
                return updated_node.with_changes(args=args)
        new = cst.Arg(keyword=cst.Name("trust_remote_code"), value=cst.Name("True"),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        if args:
            last = args[-1]
            sep = next((a.comma for a in reversed(args[:-1]) if isinstance(a.comma, cst.Comma)),
                       cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            new = new.with_changes(comma=last.comma)   # a trailing comma / newline stays at the end
            args[-1] = last.with_changes(comma=sep)
        return updated_node.with_changes(args=[*args, new])


# ---- tokenizer without pad token ---------------------------------------------------------------
def _tokenizer_load(stmt: cst.BaseStatement) -> cst.BaseAssignTargetExpression | None:
    """`<target> = <...Tokenizer...>.from_pretrained(...)` -> target."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()], value=m.Call(
            func=m.Attribute(attr=m.Name("from_pretrained"))))])):
        return None
    assign = stmt.body[0]
    try:
        owner = _dotted(assign.value.func.value)
    except ValueError:      # a call or subscript: not a tokenizer class
        return None
    return assign.targets[0].target if "Tokenizer" in owner else None


def _pad_fallback_of(stmt: cst.BaseStatement, target_code: str) -> bool:
    return isinstance(stmt, cst.If) and f"{target_code}.pad_token" in cst.Module(body=[stmt]).code


class PadTokenFallbackCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "After a tokenizer is loaded with from_pretrained, fall back to EOS as its pad token."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._module: cst.Module | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def _patch(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for i, stmt in enumerate(body):
            out.append(stmt)
            target = _tokenizer_load(stmt)
            if target is None:
                continue
            name = cst.Module(body=[]).code_for_node(target)
            if i + 1 < len(body) and _pad_fallback_of(body[i + 1], name):
                continue
            module = self._module
            out.append(cst.parse_statement(
                f"if {name}.pad_token is None:  # batches need padding: pad with EOS (masked out){module.default_newline}"
                f"{module.default_indent}{name}.pad_token = {name}.eos_token{module.default_newline}",
                config=module.config_for_parsing))
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node

    def leave_Module(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node


# ---- old rope_scaling schema --------------------------------------------------------------------
class RopeScalingTypeKeyCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Read rope_scaling[\"type\"] (renamed rope_type in transformers >= 4.45) as .get(\"type\", .get(\"rope_type\"))."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._targets = 0

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets += 1

    def leave_AssignTarget(self, original_node, updated_node):
        self._targets -= 1
        return updated_node

    def leave_Subscript(self, original_node: cst.Subscript, updated_node: cst.Subscript) -> cst.BaseExpression:
        value = updated_node.value
        if self._targets or not m.matches(value, m.Name("rope_scaling") | m.Attribute(attr=m.Name("rope_scaling"))) \
                or not _attribute_chain(value) or len(updated_node.slice) != 1 \
                or not m.matches(updated_node.slice[0], m.SubscriptElement(slice=m.Index(
                    value=m.SimpleString('"type"') | m.SimpleString("'type'")))):
            return updated_node
        quote = updated_node.slice[0].slice.value.value[0]
        get = cst.Attribute(value=value, attr=cst.Name("get"))
        inner = cst.Call(func=get, args=[cst.Arg(cst.SimpleString(f"{quote}rope_type{quote}"))])
        return cst.Call(func=get, args=[
            cst.Arg(cst.SimpleString(f"{quote}type{quote}"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
            cst.Arg(inner)])


def _attribute_chain(node: cst.BaseExpression) -> bool:
    """a / a.b.c: cheap and side-effect free to evaluate twice."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


# ---- infer.py without a warm-up generation --------------------------------------------------
def generate_calls(node: cst.CSTNode) -> list[cst.Call]:
    return m.findall(node, m.Call(func=m.Attribute(attr=m.Name("model_generate"))))


def warm_up_argument(call: cst.Call) -> bool | None:
    """True/False for warm_up=<literal>, None when the call has no warm_up argument."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "warm_up":
            return not (isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None"))
    return None if len(call.args) < 2 else True   # model_generate(prompts, True)


class InsertWarmUpCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Insert `<runner>.model_generate(prompts, warm_up=True)` before the first formal generation."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._module: cst.Module | None = None
        self._done = False

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        self._done = any(warm_up_argument(c) for c in generate_calls(node))   # a warm-up is there already

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if self._done:
            return updated_node
        formal = next((c for c in generate_calls(updated_node) if c.args and warm_up_argument(c) is None), None)
        if formal is None:
            return updated_node
        module = self._module
        inserted = f"{module.code_for_node(formal.func)}({module.code_for_node(formal.args[0].value)}, warm_up=True)"
        self._done = True
        self.context.scratch["inserted"] = inserted
        warm = cst.parse_statement(inserted + module.default_newline, config=module.config_for_parsing)
        # The warm-up takes the formal call's leading comments/blank lines: directly before it.
        return cst.FlattenSentinel([warm.with_changes(leading_lines=updated_node.leading_lines),
                                    updated_node.with_changes(leading_lines=())])


# ---- upstream's common issues (model-infer-migrator references/common_issues.md) -------------------
def _ends_with(node: cst.BaseExpression, name: str) -> bool:
    """`forward_metadata`, `self.forward_metadata`, `kwargs.forward_metadata`, ... (a dotted name)."""
    try:
        return _dotted(node).split(".")[-1] == name
    except Exception:  # noqa: BLE001 - a call or subscript: not a plain dotted name
        return False


class DecodeAttentionMaskCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = ("At decode, no prefill causal mask: `m = forward_metadata.attention_mask` becomes "
                   "`m = forward_metadata.attention_mask if forward_metadata.is_prefill else None`.")

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._has_branch: list[bool] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        # a function that already looks at is_prefill decides the mask itself
        self._has_branch.append(bool(m.findall(node, m.Attribute(attr=m.Name("is_prefill")))))

    def leave_FunctionDef(self, original_node, updated_node):
        self._has_branch.pop()
        return updated_node

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        value = updated_node.value
        if not self._has_branch or self._has_branch[-1] or len(updated_node.targets) != 1:
            return updated_node
        if not (isinstance(value, cst.Attribute) and value.attr.value == "attention_mask"
                and _ends_with(value.value, "forward_metadata")):
            return updated_node
        metadata = value.value
        return updated_node.with_changes(value=cst.IfExp(
            test=cst.Attribute(value=metadata, attr=cst.Name("is_prefill")), body=value, orelse=cst.Name("None")))


_PROCESS_WEIGHTS = '''
def process_weights_after_loading(self):
    """Called by the framework after loading: each module's quant_method repacks its weights."""
    for _, module in self.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(module)
'''


class AddProcessWeightsAfterLoadingCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Give one model class the process_weights_after_loading hook the framework calls after loading."

    def __init__(self, context: CodemodContext, class_name: str):
        super().__init__(context)
        self.class_name = class_name

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if updated_node.name.value != self.class_name or not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = list(updated_node.body.body)
        if any(isinstance(s, cst.FunctionDef) and s.name.value == "process_weights_after_loading" for s in body):
            return updated_node
        method = cst.parse_statement(_PROCESS_WEIGHTS.lstrip("\n"))
        method = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        return updated_node.with_changes(body=updated_node.body.with_changes(body=[*body, method]))


class PerRankBatchSizeCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = ("Size per-rank buffers by scheduler_config.batch_size_per_dp_rank, not the global "
                   "scheduler_config.batch_size.")

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.Attribute:
        if updated_node.attr.value == "batch_size" and _ends_with(updated_node.value, "scheduler_config"):
            return updated_node.with_changes(attr=cst.Name("batch_size_per_dp_rank"))
        return updated_node

    def leave_AssignTarget(self, original_node: cst.AssignTarget, updated_node: cst.AssignTarget):
        return updated_node.with_changes(target=original_node.target)    # a write of batch_size stays one
