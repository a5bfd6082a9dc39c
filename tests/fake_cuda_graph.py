"""A CPU stand-in for torch.cuda's graph API, for tests/test_rollout_graphs.py.

`FakeGraphs` is what `nanokl.engine.graphs.graph_api` holds during those tests. It keeps what matters of
CUDA graph semantics: capture records the aten ops of the decode step (a TorchDispatchMode) and
leaves no trace (every buffer it wrote is restored: a real capture runs nothing); replay
re-executes those ops on the same static tensors, so in-place writes land in the captured buffers,
intermediates are recomputed, and Python values stay frozen at capture. A host sync during capture
is an error, as is a random op on a generator not registered with the graph (CUDA's default
generator is always registered). `host_sync`, `written` and `storage` also serve the step audit.
"""

import contextlib

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that make the host wait for the device (or whose output shape depends on tensor values)
HOST_SYNCS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.masked_select,
              aten.equal, aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.bincount,
              aten.histc, aten.allclose}


def host_sync(func, args, kwargs):
    if func.overloadpacket in HOST_SYNCS or (func.overloadpacket is aten.repeat_interleave
                                             and "output_size" not in kwargs and func is aten.repeat_interleave.Tensor):
        return True
    # boolean-mask indexing (x[mask], x[mask] = y) needs the count of True entries on the host
    if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1]))
    return False


def written(func, args, kwargs):
    """The tensors an aten op writes: its arguments marked mutable in the schema (in-place, out=)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out += [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
    return out


def storage(t):
    return t.untyped_storage().data_ptr()


def same_generator(a, b):
    """Whether two Python handles wrap one generator (dispatch hands ops a new handle): reseed one,
    see whether the other follows, put the state back."""
    saved = b.get_state()
    b.manual_seed(int(torch.randint(2**62, (1,))))  # a seed unlikely to be anyone's state
    same = torch.equal(a.get_state(), b.get_state())
    b.set_state(saved)
    return same


# ----------------------------------------------------------------------------------------------
# The stand-in for torch.cuda's graph API


class FakeGraph:
    def __init__(self, fake):
        self.ops, self.generators = [], []
        fake.graphs.append(self)

    def register_generator_state(self, gen):
        self.generators.append(gen)

    def replay(self):
        fresh = {}  # id(captured intermediate) -> its value in this replay

        def current(x):
            return fresh.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            result = func(*tree_map(current, args), **tree_map(current, kwargs))
            for old, new in zip(tree_leaves(out), tree_leaves(result)):
                if isinstance(old, torch.Tensor):
                    fresh[id(old)] = new


class Recorder(TorchDispatchMode):
    """Records every aten op into the graph; undoes the writes into pre-existing storage at exit."""

    def __init__(self, graph):
        super().__init__()
        self.graph, self.made, self.outside, self.saved = graph, set(), set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_sync(func, args, kwargs):
            raise RuntimeError(f"{func} synchronizes with the host: not permitted while capturing")
        for g in tree_leaves((args, kwargs)):
            if isinstance(g, torch.Generator) and not any(
                    same_generator(g, r) for r in [torch.default_generator, *self.graph.generators]):
                raise RuntimeError("a random op drew from a generator not registered with the graph")
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.made:
                self.outside.add(storage(t))
        for t in written(func, args, kwargs):
            if storage(t) in self.outside and storage(t) not in self.saved:
                self.saved[storage(t)] = (t.untyped_storage(), t.untyped_storage().clone())
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        self.made |= {id(o) for o in tree_leaves(out) if isinstance(o, torch.Tensor)}
        return out

    def undo(self):
        for st, copy in self.saved.values():
            st.copy_(copy)


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeGraphs:
    """What graphs.graph_api holds, for graphs that run on CPU tensors."""
    device_type = "cpu"

    def __init__(self):
        self.graphs = []  # every graph captured, counted here independently of the engine's counters

    def CUDAGraph(self):
        return FakeGraph(self)

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):
        states = [gen.get_state() for gen in g.generators]
        rec = Recorder(g)
        with rec:
            yield g
        rec.undo()
        for gen, s in zip(g.generators, states):
            gen.set_state(s)

    Stream = FakeStream

    def stream(self, s):
        return contextlib.nullcontext()

    def current_stream(self):
        return FakeStream()

    def graph_pool_handle(self):
        return object()
