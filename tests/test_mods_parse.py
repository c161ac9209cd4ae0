"""The mods' text form: it round-trips, and anything outside the whitelist is one SpecError line, never a
traceback, never evaluated."""

import pytest

from fagen.mods import ir
from fagen.mods.text import canonical, parse, parse_scalar_decl, parse_tensor_decl, to_text
from fagen.errors import SpecError

TENSORS = (("bias", "fp32", 2), ("doc", "i32", 1), ("s0", "fp32", 0))
SCALARS = (("cap", "float"), ("w", "int"))


def _balanced(levels: int) -> str:
    """A wide, shallow sum of 2**levels terms `h`: many nodes, little depth."""
    return "h" if levels == 0 else f"({_balanced(levels - 1)}+{_balanced(levels - 1)})"


@pytest.mark.parametrize("text", [
    "score + bias[h, q_idx - kv_idx + 4095]",
    "cap * tanh(score / cap)",
    "score + (kv_idx - q_idx) * exp2(-((h + 1) * 8.0 / 16))",
    "where((q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx]), score, -inf)",
    "score - -1 * s0[()] + minimum(score, 2.5) - maximum(-score, 1e-06) + clamp(score, -w, w)",
    "score * (q_idx // w % 3 - kv_idx % -2) / sqrt(abs(score) + 1.0) + log(sigmoid(score)) + exp(-score)",
    "-(score + 1.0) * -score - (score - (1.0 - score))",
    "where(~(q_idx < w) | (b != 0), score, score * 0.5)",
])
def test_round_trip(text):
    tree = parse(text, "score_mod", TENSORS, SCALARS)
    assert to_text(tree) == text
    assert parse(to_text(tree), "score_mod", TENSORS, SCALARS) == tree


def test_parentheses_alone_do_not_nest():
    assert parse("score + " + "(" * 100 + "1.0" + ")" * 100) == parse("score + 1.0")


def test_canonical_text_normalises_spelling():
    assert to_text(parse("score+bias[ h,(q_idx-kv_idx)+4095 ]", tensors=TENSORS)) == \
        "score + bias[h, q_idx - kv_idx + 4095]"
    assert to_text(parse("(score)*((2.0))")) == "score * 2.0"
    assert to_text(parse("score + 2 * 3")) == "score + 6"  # constants fold
    assert to_text(parse("(q_idx >= kv_idx) & True", "mask_mod")) == "q_idx >= kv_idx"


@pytest.mark.parametrize("text, says", [
    ("score.__class__", "attribute access"),
    ("__import__('os').system('touch /tmp/fagen-pwned')", "calls only"),
    ("score + __builtins__", "unknown name"),
    ("eval('1') + score", "calls only"),
    ("open('/etc/passwd')", "calls only"),
    ("exp(score, 2)", "takes 1 positional"),
    ("exp(x=score)", "takes 1 positional"),
    ("score + 'a'", "str literal"),
    ("score + b'a'", "bytes literal"),
    ("score + f'{score}'", "a string"),
    ("(lambda: score)()", "calls only"),
    ("lambda: score", "a lambda"),
    ("[score for score in (1,)]", "a comprehension"),
    ("score if q_idx else 0.0", "if-expression"),
    ("score and score", "`and`/`or`"),
    ("score ** 2", "operator is not allowed"),
    ("score @ score", "operator is not allowed"),
    ("score + 99999999999999999999", "does not fit int32"),
    ("score + 1e300", "overflows fp32"),
    ("score + " + "exp(" * 40 + "1.0" + ")" * 40, "nests deeper"),
    ("score + " + "(" * 300 + "1.0" + ")" * 300, "not a valid expression"),  # Python's parser stops at 200
    ("-" * 40 + "score", "nests deeper"),
    ("score + " + _balanced(10), "more than 1024 nodes"),
    ("score" + " + 1.0" * 2000, "longer than 8000"),
    ("score + bogus", "unknown name"),
    ("score + cap[0]", "only a declared tensor"),
    ("score + h[0]", "only a declared tensor"),
    ("score + bias", "must be indexed"),
    ("score + bias[h]", "takes exactly 2 indices"),
    ("score + bias[h, 1.5]", "index of bias is a float"),
    ("score + bias[h, 0:3]", "a slice"),
    ("score + doc[q_idx < 3]", "index of doc is a bool"),
    ("q_idx < kv_idx < 3", "one comparison"),
    ("score in (1, 2)", "one comparison"),
    ("q_idx", "must give a float score"),
    ("score +", "not a valid expression"),
    ("score\x00", "not a valid expression"),
    ("score; import os", "not a valid expression"),
    ("score & 1", "on a float"),
    ("~score", "on a float"),
    ("-(q_idx < 1) + score", "on a bool"),
    ("exp(q_idx < 1)", "of a bool"),
    ("where(q_idx, score, 0.0)", "bool condition"),
    ("score + log(-1.0)", "constant expression fails"),
    ("score + 1 // 0", "constant expression fails"),
    ("{score}", "a set"),
    ("score[0]", "only a declared tensor"),
    ("(score := 1.0)", "assignment expression"),
    ("*score", "not a valid expression"),
    (["score"], "must be an expression string"),
])
def test_refused_with_one_line(text, says):
    with pytest.raises(SpecError) as e:
        parse(text, "score_mod", TENSORS, SCALARS)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith("score_mod: "), msg
    assert len(msg) < 400


def test_mask_mod_has_no_score_and_returns_bool():
    with pytest.raises(SpecError, match="a mask_mod has no score"):
        parse("score > 0", "mask_mod")
    with pytest.raises(SpecError, match="must give a bool"):
        parse("q_idx - kv_idx", "mask_mod")
    assert parse("(q_idx >= kv_idx) & (b % 2 == 0)", "mask_mod").type == ir.BOOL


def test_declarations():
    assert parse_tensor_decl("bias=fp32:2") == ("bias", "fp32", 2)
    assert parse_scalar_decl("cap=float") == ("cap", "float")
    for bad, says in [("bias=fp32", "NAME=DTYPE:RANK"), ("bias=fp64:2", "dtype must be one of"),
                      ("bias=fp32:9", "rank must be"), ("__class__=fp32:1", "a name is a letter"),
                      ("score=fp32:1", "reserved"), ("where=i32:1", "reserved"), ("a.b=fp32:1", "a name is a letter")]:
        with pytest.raises(SpecError, match=says):
            parse_tensor_decl(bad)
    with pytest.raises(SpecError, match="type must be"):
        parse_scalar_decl("cap=str")


def test_canonical_fields():
    out = canonical("score+bias[h,q_idx-kv_idx]*cap", "doc[q_idx]==doc[kv_idx]",
                    [["doc", "i32", 1], ["bias", "fp32", 2]], [["cap", "float"]])
    assert out == ("score + bias[h, q_idx - kv_idx] * cap", "doc[q_idx] == doc[kv_idx]",
                   (("bias", "fp32", 2), ("doc", "i32", 1)), (("cap", "float"),))
    with pytest.raises(SpecError, match="declared but no mod uses it"):
        canonical("score", None, [["bias", "fp32", 2]], ())
    with pytest.raises(SpecError, match="declared twice"):
        canonical("score + bias[h, h]", None, [["bias", "fp32", 2]], [["bias", "int"]])
