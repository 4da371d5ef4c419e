"""A block's key references: the compact forms (a bare key name for the owning namespace,
one (ns, key), a list) read back the same whatever order keys come and go in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from epistemic_kvcache.store.engine import _Blob

REFS = st.lists(
    st.tuples(st.sampled_from(["t", "t/snap", "u"]), st.sampled_from(["a", "b", "c"])),
    unique=True,
    max_size=6,
)


@given(refs=REFS, owner=st.sampled_from(["t", "u"]), data=st.data())
def test_key_refs_match_a_plain_list(
    refs: list[tuple[str, str]], owner: str, data: st.DataObject
) -> None:
    b = _Blob(b"d" * 33, 10)
    b.owner = owner
    model: list[tuple[str, str]] = []
    for ref in refs:
        b.add_keyref(ref)
        model.append(ref)
        assert sorted(b.key_refs()) == sorted(model)
    for ref in data.draw(st.permutations(refs)):
        b.remove_keyref(ref)
        model.remove(ref)
        assert sorted(b.key_refs()) == sorted(model)
    assert b.keys is None


def test_one_key_of_the_owner_is_stored_bare() -> None:
    b = _Blob(b"d" * 33, 10)
    b.owner = "t"
    b.add_keyref(("t", "k"))
    assert b.keys == "k"
    assert b.key_refs() == [("t", "k")]
    b.add_keyref(("t/snap", "k"))
    assert b.key_refs() == [("t", "k"), ("t/snap", "k")]
    b.remove_keyref(("t", "k"))
    assert b.keys == ("t/snap", "k")


def test_global_scope_owner_keeps_tuples() -> None:
    b = _Blob(b"d" * 33, 10)
    b.owner = {}
    b.add_keyref(("t", "k"))
    assert b.keys == ("t", "k")
