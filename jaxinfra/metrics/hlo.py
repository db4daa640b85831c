"""What each op of a compiled program is: the compiled HLO text (`compiled.as_text()`) parsed into
its instructions, and each instruction a profile can name put in one category of the step.

A profiler trace names ops by their HLO instruction (`fusion.12`, `custom-call.3`, a cuBLAS gemm's
custom call); what they compute is in the HLO text: the instructions a fusion's body holds, a
custom call's target, and the `op_name` metadata (the JAX name stack, where `jax.named_scope`
markers land). The train step marks two scopes (jaxinfra/step.py): `LOSS_SCOPE` around the output
projection and cross-entropy, `OPTIMIZER_SCOPE` around the gradient scaling, norm, optimizer update
and the non-finite guard. Their backward ops keep the marker (`transpose(jvp(loss_and_logits))`).

Rules, first match wins (`classify`):
  collectives  all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
               (also async -start/-done, and fusions holding one)
  attention    custom calls of fused kernels: cuDNN fmha, Triton / Pallas / Mosaic (the only custom
               kernels of this model are attention's)
  loss         anything under LOSS_SCOPE (the logits matmul included)
  optimizer    anything under OPTIMIZER_SCOPE
  attention    a dot with batch dimensions (XLA's unfused attention: scores and weighted values;
               every projection and MLP matmul is 2-D)
  matmul       any other dot / convolution, a cuBLAS / cuDNN gemm custom call, a fusion holding one
  elementwise  fusions and ops that compute (norms, activations, softmax pieces, reductions)
  other        data movement (copies, transposes, slices, gathers / scatters), control flow, the rest
"""

from __future__ import annotations

import dataclasses
import re

LOSS_SCOPE = "loss_and_logits"
OPTIMIZER_SCOPE = "optimizer_update"

MATMUL, ATTENTION, LOSS, ELEMENTWISE = "matmuls", "attention", "loss and logits", "norms and elementwise"
COLLECTIVES, OPTIMIZER, HOST_GAPS, OTHER = "collectives", "optimizer update", "host gaps", "other"
CATEGORIES: tuple[str, ...] = (MATMUL, ATTENTION, LOSS, ELEMENTWISE, COLLECTIVES, OPTIMIZER, HOST_GAPS, OTHER)

_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute"
                         r"|collective-broadcast)(-start|-done)?$")
_ATTENTION_TARGET = re.compile(r"fmha|cudnn\$.*(attention|sdpa)|triton|pallas|mosaic|tpu_custom_call", re.I)
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$conv|cudnn\$fusion", re.I)
_MOVEMENT = frozenset({
    "parameter", "constant", "bitcast", "copy", "copy-start", "copy-done", "transpose", "reshape", "broadcast",
    "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "iota",
    "tuple", "get-tuple-element", "reverse", "bitcast-convert", "send", "send-done", "recv", "recv-done",
    "infeed", "outfeed", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
})
CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start", "async-update", "async-done"})

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$")
_CALLED_ONE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_MANY = re.compile(r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ELEMENT = re.compile(r"(\w+)\[")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    op_name: str  # JAX name stack from the metadata ("" when absent)
    calls: tuple[str, ...]  # computations it calls (fusion body, while body / condition, reducer...)
    target: str = ""  # custom_call_target
    batched_dot: bool = False  # a dot with batch dimensions
    scalar: bool = False  # its result is a scalar (index arithmetic in a slicing fusion, loop counters)
    dtype: str = ""  # the result's element type (`bf16`, `f32`; "" for a tuple)
    operands: tuple[str, ...] = ()  # the instructions it reads, by name


@dataclasses.dataclass
class HloModule:
    name: str
    instructions: dict[str, Instruction]  # every instruction of every computation, by (module-unique) name
    computations: dict[str, list[str]]  # computation -> its instructions' names


def skip_shape(text: str) -> str:
    """`text` after the leading shape (`f32[8,4]{1,0}`, a tuple `(s32[], f32[2])`, layouts with
    parentheses), i.e. starting at the opcode."""
    depth, i = 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            return text[i + 1:]
    return text[i + 1:]


def _instruction(name: str, rest: str) -> Instruction:
    body = skip_shape(rest)
    opcode = body.split("(", 1)[0].strip()
    calls = _CALLED_ONE.findall(body)
    for group in _CALLED_MANY.findall(body):
        calls += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    op_name = _OP_NAME.search(body)
    target = _TARGET.search(body)
    args = body[len(opcode):].split(")", 1)[0]
    return Instruction(name=name, opcode=opcode, op_name=op_name.group(1) if op_name else "",
                       calls=tuple(calls), target=target.group(1) if target else "",
                       batched_dot=opcode == "dot" and "lhs_batch_dims={" in body,
                       scalar=re.match(r"\w+\[\]", rest) is not None,
                       dtype=_ELEMENT.match(rest).group(1) if _ELEMENT.match(rest) else "",
                       operands=tuple(_OPERAND.findall(args)))


def parse_hlo(text: str) -> HloModule:
    """The instructions of every computation of an HLO module's text form."""
    first = text.split("\n", 1)[0]
    module = first.split()[1].rstrip(",") if first.startswith("HloModule ") else ""
    instructions: dict[str, Instruction] = {}
    computations: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("}"):
            current = None
            continue
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault(head.group(1), [])
            continue
        inst = _INSTRUCTION.match(line) if current is not None else None
        if inst:
            instructions[inst.group(1)] = _instruction(inst.group(1), inst.group(2))
            current.append(inst.group(1))
    return HloModule(module, instructions, computations)


def _in_scope(op_name: str, scope: str) -> bool:
    """Whether a name stack holds `scope` as a component, also wrapped (`transpose(jvp(scope))`)."""
    return re.search(rf"(^|[/(]){re.escape(scope)}([)/]|$)", op_name) is not None


def body_instructions(module: HloModule, inst: Instruction) -> list[Instruction]:
    """Every instruction a fusion (or any op) computes: its called computations, recursively."""
    out, seen, todo = [], set(), list(inst.calls)
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in module.computations:
            continue
        seen.add(comp)
        for name in module.computations[comp]:
            sub = module.instructions[name]
            out.append(sub)
            todo.extend(sub.calls)
    return out


def classify(module: HloModule, name: str) -> str:
    """The category (one of CATEGORIES, never HOST_GAPS) of the instruction a trace names `name`."""
    inst = module.instructions.get(name)
    if inst is None:
        return OTHER
    nested = inst.opcode == "fusion" or inst.opcode.startswith("async-")
    inside = [inst] + (body_instructions(module, inst) if nested else [])
    opcodes = {i.opcode for i in inside}
    if any(_COLLECTIVE.match(op) for op in opcodes):
        return COLLECTIVES
    targets = [i.target for i in inside if i.opcode == "custom-call"]
    if any(_ATTENTION_TARGET.search(t) for t in targets):
        return ATTENTION
    dots = [i for i in inside if i.opcode in ("dot", "convolution")]
    keys = dots or inside  # a fusion's scope: its matmul's, else that of any op it computes
    for scope, category in ((LOSS_SCOPE, LOSS), (OPTIMIZER_SCOPE, OPTIMIZER)):
        if any(_in_scope(k.op_name, scope) for k in keys):
            return category
    if any(d.batched_dot for d in dots):
        return ATTENTION
    if dots or any(_GEMM_TARGET.search(t) for t in targets):
        return MATMUL
    computing = {i.opcode for i in inside if not i.scalar}
    if computing <= _MOVEMENT | CONTROL_FLOW | {"fusion", "custom-call"}:
        return OTHER
    return ELEMENTWISE


def dots(module: HloModule) -> list[tuple[Instruction, tuple[str, ...]]]:
    """Every dot and ragged dot of the program (inside fusions too) with its operands' element types, as
    the compiler left them: an operand XLA converted up to float32 before the dot reads `f32` here."""
    out = []
    for inst in module.instructions.values():
        if inst.opcode in ("dot", "ragged-dot"):
            out.append((inst, tuple(module.instructions[o].dtype for o in inst.operands
                                    if o in module.instructions)))
    return out
