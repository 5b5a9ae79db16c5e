import numpy as np
import pytest

from cannc.ir.graph import Graph, Node, verify
from cannc.ir.types import TensorType

F = np.dtype(np.float32)


def _chain() -> Graph:
    g = Graph()
    g.inputs = ["x"]
    g.values["x"] = TensorType(F, ("b", 4))
    g.values["y"] = TensorType(F, ("b", 4))
    g.values["z"] = TensorType(F, ("b", 4))
    g.add_node(Node("n1", "Relu", ("x",), ("y",)))
    g.add_node(Node("n2", "Neg", ("y",), ("z",)))
    g.outputs = ["z"]
    return g


def test_producer_consumers_and_order():
    g = _chain()
    verify(g)
    assert g.producer("y").name == "n1"
    assert g.consumers("y") == ["n2"]
    assert [n.name for n in g.nodes()] == ["n1", "n2"]
    assert "Relu" in g.dump()


def test_replace_uses_and_remove():
    g = _chain()
    g.replace_uses("y", "x")
    assert g.node("n2").inputs == ("x",)
    g.remove_node("n1")
    verify(g)
    assert g.num_nodes() == 1


def test_verify_catches_use_before_def():
    g = _chain()
    g.add_node(Node("n3", "Neg", ("nope",), ("w",)))
    g.values["w"] = TensorType(F, (1,))
    with pytest.raises(AssertionError, match="before it is defined"):
        verify(g)


def test_tensor_type():
    t = TensorType(F, (2, 3))
    assert t.numel == 6 and t.nbytes == 24 and t.is_static and str(t) == "float32[2x3]"
    assert not TensorType(F, ("b", 3)).is_static


def test_a_pickled_node_leaves_its_onnx_proto_behind_unless_it_has_subgraphs():
    """Node.proto is a cache of the node's ONNX form: a pickled program (the program
    cache) must not carry it, or loading the program would import onnx; a control-flow
    node keeps it (ir.ops.control.own_inputs reads its own input count from it)."""
    import pickle

    from onnx import helper

    p = helper.make_node("Relu", ["x"], ["y"], name="r")
    n = Node("r", "Relu", ("x",), ("y",), proto=p)
    back = pickle.loads(pickle.dumps(n))
    assert back.proto is None and back == n and back.attrs == n.attrs
    assert n.proto is p                       # the original keeps it
    body = Graph("body")
    iff = Node("i", "If", ("c", "outer"), ("z",), attrs={"then_branch": body},
               proto=helper.make_node("If", ["c"], ["z"], name="i"))
    back = pickle.loads(pickle.dumps(iff))
    assert list(back.proto.input) == ["c"]
    from cannc.ir.ops.control import own_inputs
    assert own_inputs(back) == ("c",)


def test_a_pickled_graph_rebuilds_the_same_structure_on_first_use():
    """Graph pickles its nodes as rows, not as a networkx graph (unpickling one would
    import networkx into a process that only runs cached programs); the first use of
    `g` rebuilds nodes, orders and edges as they were, after removals and re-adds."""
    import copy
    import pickle

    g = _chain()
    g.values["w"] = g.values["v"] = TensorType(F, ("b", 4))
    g.add_node(Node("n3", "Add", ("y", "z"), ("w",)), order=0.5)  # before n1 in order
    g.add_node(Node("n4", "Mul", ("w", "w"), ("v",)))             # one value read twice
    g.remove_node("n2")
    g.add_node(Node("n2b", "Neg", ("y",), ("z",)))                # z's new producer
    for back in (pickle.loads(pickle.dumps(g)), copy.deepcopy(g)):
        assert back._g is None                                   # not built yet
        assert sorted(back.g.edges(keys=True)) == sorted(g.g.edges(keys=True))
        assert dict(back.g.nodes(data="order")) == dict(g.g.nodes(data="order"))
        assert [n.name for n in back.nodes()] == [n.name for n in g.nodes()]
        back.add_node(Node("n5", "Relu", ("v",), ("u",)))        # and it goes on working
        assert back.consumers("v") == ["n5"] and ("n4", "n5", "v") in back.g.edges(keys=True)
    g.outputs = ["v"]
    verify(pickle.loads(pickle.dumps(g)))


def test_a_copied_graph_has_the_same_structure_and_changes_alone():
    """Graph.copy builds networkx's dicts itself (faster than networkx's copy): the same
    nodes, orders, keyed edges both ways and successors as the original, and no dict
    shared with it, so passes on the copy leave the original as it was."""
    g = _chain()
    g.values["w"] = g.values["v"] = TensorType(F, ("b", 4))
    g.add_node(Node("n3", "Add", ("y", "z"), ("w",)), order=0.5)
    g.add_node(Node("n4", "Mul", ("w", "w"), ("v",)))            # one value read twice
    c = g.copy()
    assert sorted(c.g.edges(keys=True, data=True)) == sorted(g.g.edges(keys=True, data=True))
    assert sorted(c.g.in_edges(keys=True)) == sorted(g.g.in_edges(keys=True))
    assert dict(c.g.nodes(data=True)) == dict(g.g.nodes(data=True))
    assert {u: set(s) for u, s in c.successors().items()} == \
        {u: set(s) for u, s in g.successors().items()} == \
        {"n1": {"n2", "n3"}, "n2": {"n3"}, "n3": {"n4"}, "n4": set()}
    assert [n.name for n in c.nodes()] == [n.name for n in g.nodes()]
    verify(c)
    before = (sorted(g.g.edges(keys=True)), dict(g.g.nodes(data="order")))
    c.remove_node("n3")
    c.add_node(Node("n3b", "Sub", ("y", "x"), ("w",)))
    c.g.nodes["n1"]["order"] = 7
    assert (sorted(g.g.edges(keys=True)), dict(g.g.nodes(data="order"))) == before
    assert sorted(g.g.predecessors("n4")) == ["n3"]
    assert sorted(c.g.predecessors("n4")) == ["n3b"] and ("n1", "n3b", "y") in c.g.edges(keys=True)
