"""The ``"nccl"`` process group: torch's collective API adapted to a transport-neutral call.

``init_process_group("nccl")`` is routed here (``shim/comm/c10d_patches.py``; the
CPU build refuses the real NCCL) while ``dist.get_backend()`` still answers
``"nccl"``. Each method (``allreduce``, ``broadcast``, ...) checks its tensors
as ProcessGroupNCCL does, takes their CPU data and calls :meth:`_run` once per
collective, with a ``deliver`` that copies the flat output back into the
caller's tensors. :meth:`_run` asks the communicator's transports
(``shim/transport/transports.py``, :meth:`Paths.path <shim.transport.paths.Paths.path>`)
which one carries the collective, and that transport posts it to the daemon;
the returned ``Work`` (``shim/transport/stream.py``) completes the rank's
collectives in the order they were posted, as on one stream.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from shim.comm import fault_injection
from shim.comm.call_args import cpu_via_gloo, flat, gpu_of, into, into_each, reduction
from shim.comm.call_forms import c10d_forms
from shim.cuda import graphs
from shim.rank.runtime import RUNTIME
from shim.transport import profiler as prof
from shim.transport import across_hosts, stream
from shim.rank.call_site import call_site
from shim.transport.nccl_errors import nccl_error
from shim.transport.stream import P2PWork, Pending
from shim.transport.paths import Paths
from shim.transport.transports import Call, Comm, route
from wire import schema as s

IN_PROCESS_MESSAGE = (
    "--in-process gives each process its own emulator; multi-process collectives need the daemon "
    "— drop --in-process"
)
#: Longest group description sent to the daemon: it is only ever shown, and every rank's join repeats it.
MAX_DESC_CHARS = 256



def _start_stride(ranks: list[int]) -> tuple[int, int]:
    """A group's first global rank and the stride between its ranks (-1: uneven), as ProcessGroupNCCL has them."""
    if not ranks:  # the default group
        return 0, 1
    if len(ranks) == 1:
        return ranks[0], 0
    stride = ranks[1] - ranks[0]
    even = all(b - a == stride for a, b in zip(ranks, ranks[1:]))
    return ranks[0], stride if even else -1


class MirageProcessGroup(dist.ProcessGroup):
    """A communicator of ``size`` ranks, matched in the daemon by a store-agreed id."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, cpu=None):
        super().__init__(rank, size)
        self._cpu = cpu  # gloo, for CPU tensors, when the group was asked for "cpu:gloo,cuda:nccl"
        self._rank, self._size = rank, size
        self._p2p_seq: dict[tuple[s.CollOp, int], int] = {}  # messages so far, per (direction, peer)
        # the default group is built before torch records it (and again after destroy_process_group)
        self._is_default = not dist.is_initialized()
        if self._is_default:
            fault_injection.choose(rank)
        self._in_process = RUNTIME.settings.in_process
        # torch sets the group's name and description once the backend exists; the daemon hears of the
        # communicator now, so they are taken from the helper's arguments (RUNTIME.comm.creating)
        creating = RUNTIME.comm.creating
        self._comm = Comm("", rank, size, None, timeout.total_seconds(), _start_stride(creating.ranks),
                          group_name=creating.name, group_desc=creating.desc)
        if self._in_process:
            if size > 1:
                raise dist.DistBackendError(IN_PROCESS_MESSAGE)
            self._paths = Paths(self._comm, None)
            return
        # rank 0 mints the communicator id, as NCCL's ncclUniqueId travels through the store. A
        # store prefix can serve several groups (the same ranks split twice, init after destroy):
        # each rank's k-th group under it reads the k-th id.
        key = f"mirage_comm_id/{store.add(f'mirage_comm_count/{rank}', 1)}"
        if rank == 0:
            store.set(key, uuid.uuid4().hex)
        self._comm.id = store.get(key).decode()
        host = os.environ.get("NCCL_HOSTID", socket.gethostname())
        chosen = route(store, self._comm.id, rank, size, host)
        self._comm.client = client = chosen.client
        path = chosen.path
        init = s.CommInit(
            comm=self._comm.id,
            rank=rank,
            size=size,
            # not $RANK: mp.spawn children all inherit their parent's
            global_rank=rank if self._is_default else dist.get_rank(),
            node=RUNTIME.settings.node_rank,
            host=host,
            transport=path,
            name=creating.name[:MAX_DESC_CHARS],
            desc=creating.desc[:MAX_DESC_CHARS],
        )
        reply = client.request(init)
        if isinstance(reply, s.Error):
            raise nccl_error(reply.code, reply.message, RUNTIME.device.current)
        # members on several hosts: this host's daemon may carry their data, the head's keeps the books
        across = None
        if chosen.hosts:
            across = across_hosts.share(self._comm, chosen, RUNTIME.host_client(), init)
        self._paths = Paths(self._comm, path, across)

    # -- identity (functional collectives, DTensor and FSDP2 look groups up by name)
    def getBackendName(self) -> str:
        return "nccl"

    def setGroupName(self, name: str) -> None:
        self._comm.group_name = name

    def getGroupName(self) -> str:
        return self._comm.group_name

    def setGroupDesc(self, desc: str) -> None:
        self._comm.group_desc = desc

    def getGroupDesc(self) -> str:
        return self._comm.group_desc

    @property
    def group_name(self) -> str:
        return self._comm.group_name

    @property
    def _device_types(self) -> list[torch.device]:
        # what torch picks object-collective and state-dict broadcast devices from (the C++
        # group's registered types stay empty for a Python group): cuda, as a real NCCL group
        return [torch.device("cpu"), torch.device("cuda")] if self._cpu is not None else [torch.device("cuda")]

    def _get_backend(self, device: torch.device):
        """The group serving ``device``: itself for the GPUs (not a ``ProcessGroupNCCL``, which a CPU build
        lacks: c10d's helpers that look for one, such as inductor's ephemeral timeouts, pass it by)."""
        if torch.device(device).type == "cpu":
            if self._cpu is None:
                raise RuntimeError("No backend type associated with device type cpu")
            return self._cpu
        return self

    def set_timeout(self, timeout: timedelta) -> None:
        """The group's timeout (``_set_pg_timeout``): the watchdog's deadline from now on."""
        self._comm.timeout_s = timeout.total_seconds()
        if self._cpu is not None:
            self._cpu._set_default_timeout(timeout)

    # -- every collective: one call, on the path its transports choose
    def _run(self, call: Call) -> Pending | None:
        """Post one collective; its flat output goes to ``call.deliver`` when its work completes.

        The inputs are staged (copied) now, so the caller may reuse them; the
        output is copied out when the work is waited on (or polled complete).
        An in-place collective (all-reduce, broadcast) of ``call.owner``, a large
        tensor whose data is ``inputs[0]``, may instead run on its storage
        itself (``shim.transport.shared_buffers``): nothing is copied, the daemon writes
        the tensor while the collective runs, as a GPU does.
        Returns the posted collective, or None when there is nothing to wait for.
        """
        graphs.refuse_collective()  # not a kernel on a stream: a graph's replay would not run it
        if self._is_default and fault_injection.pending() and fault_injection.inject(self._comm.seq + 1):
            return None  # skipped: this rank's code "never called" it, so its sequence number stays
        with RUNTIME.stream.lock, stream.PLAIN():
            stream.after_writers_of(call.inputs)
            return self._paths.path(call).post(call)

    def _done(self, result) -> dist.Work:
        """The work of the call that just posted its collectives: complete through the newest."""
        return stream.work_of(result)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:all_reduce", "allreduce", 0)
    def allreduce(self, tensors, opts=None):
        red = reduction(opts)
        for t in tensors:
            elem = flat(t)
            self._run(Call(s.CollOp.ALLREDUCE, [elem], elem.numel(), elem.dtype, into(elem), device=gpu_of(t), owner=t,
                           **red))
        return self._done(tensors)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:broadcast", "broadcast", 0)
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            elem = flat(t)
            mine = self._comm.rank == root
            self._run(Call(s.CollOp.BROADCAST, [elem], elem.numel(), elem.dtype, None if mine else into(elem),
                           root=root, device=gpu_of(t), stage=mine, owner=t))
        return self._done(tensors)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:all_gather", "all_gather", 1, 0)
    def allgather(self, output_lists, inputs, opts=None):
        for outs, t in zip(output_lists, inputs):
            elem = flat(t)
            n = elem.numel()
            if any(o.numel() != n for o in outs):
                # uneven sizes: one broadcast per rank, as ProcessGroupNCCL does
                for k, o in enumerate(outs):
                    buf = elem if k == self._comm.rank else flat(o)
                    self._run(Call(s.CollOp.BROADCAST, [buf], buf.numel(), buf.dtype, into(flat(o)), root=k,
                                   device=gpu_of(t), stage=k == self._comm.rank))
                continue
            self._run(Call(s.CollOp.ALLGATHER, [elem], n * self._comm.size, elem.dtype,
                           into_each([flat(o) for o in outs]), device=gpu_of(t)))
        return self._done(output_lists)

    @cpu_via_gloo
    @prof.profiled("nccl:_all_gather_base", "_allgather_base", 1, 0)
    def _allgather_base(self, output, input, opts=None):
        elem = flat(input)
        self._run(Call(s.CollOp.ALLGATHER, [elem], output.numel(), elem.dtype, into(flat(output)),
                       device=gpu_of(input)))
        return self._done([output])

    @cpu_via_gloo
    @prof.profiled("nccl:_reduce_scatter_base", "_reduce_scatter_base", 1, 0)
    def _reduce_scatter_base(self, output, input, opts=None):
        elem = flat(input)
        self._run(Call(s.CollOp.REDUCE_SCATTER, [elem], output.numel(), elem.dtype, into(flat(output)),
                       device=gpu_of(input), **reduction(opts)))
        return self._done([output])

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:reduce", "reduce", 0)
    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            elem = flat(t)
            mine = self._comm.rank == root
            # NCCL leaves non-root buffers as they were: only the root receives
            self._run(Call(s.CollOp.REDUCE, [elem], elem.numel() if mine else 0, elem.dtype,
                           into(elem) if mine else None, root=root, device=gpu_of(t), **reduction(opts)))
        return self._done(tensors)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:gather", "gather", 1, 0)
    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        elem = flat(inputs[0])
        outs = [flat(o) for o in output_lists[0]] if output_lists else []
        if outs and (len(outs) != self._comm.size or any(o.numel() != elem.numel() for o in outs)):
            raise ValueError("Tensor list output of gather must match number of collective participants "
                             "and each tensor the input's size")
        self._run(Call(s.CollOp.GATHER, [elem], elem.numel() * self._comm.size if outs else 0, elem.dtype,
                       into_each(outs) if outs else None, root=root, device=gpu_of(inputs[0])))
        return self._done(output_lists)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:scatter", "scatter", 1, 0)
    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        out = flat(outputs[0])
        sources = [flat(t) for t in input_lists[0]] if input_lists else []
        if sources and (len(sources) != self._comm.size or any(t.numel() != out.numel() for t in sources)):
            raise ValueError("Tensor list input to scatter must match number of collective participants "
                             "and each tensor the output's size")
        # numel is the per-rank share, the same on every rank; only the root stages its list
        self._run(Call(s.CollOp.SCATTER, sources, out.numel(), out.dtype, into(out), root=root,
                       device=gpu_of(outputs[0]), stage=bool(sources), numel=out.numel()))
        return self._done(outputs)

    @c10d_forms
    @cpu_via_gloo
    @prof.profiled("nccl:reduce_scatter", "reduce_scatter", 1, 0)
    def reduce_scatter(self, outputs, input_lists, opts=None):
        out = flat(outputs[0])
        parts = [flat(t) for t in input_lists[0]]
        red = reduction(opts)
        if any(p.numel() != out.numel() for p in parts):
            # uneven parts: one reduce per destination rank, as ProcessGroupNCCL does
            for k, part in enumerate(parts):
                self._run(Call(s.CollOp.REDUCE, [part], part.numel() if k == self._comm.rank else 0, part.dtype,
                               into(out) if k == self._comm.rank else None, root=k, device=gpu_of(outputs[0]), **red))
            return self._done(outputs)
        self._run(Call(s.CollOp.REDUCE_SCATTER, parts, out.numel(), out.dtype, into(out), device=gpu_of(outputs[0]),
                       **red))
        return self._done(outputs)

    @cpu_via_gloo
    @prof.profiled("nccl:all_to_all", "all_to_all", 1, 0)
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        src, dst = flat(input), flat(output)
        for t, sizes, what in ((src, input_split_sizes, "input"), (dst, output_split_sizes, "output")):
            rows = t.size(0) if t.dim() else 1
            if sizes and (len(sizes) != self._comm.size or sum(sizes) != rows):
                raise ValueError(f"Split sizes doesn't match total dim 0 size ({what}: {list(sizes)} for {rows} rows)")
            if not sizes and rows % self._comm.size:
                raise ValueError(f"Tensor's dim 0 does not divide equally across group size ({what}: {rows} rows)")
        # torch counts splits in rows of dim 0; the daemon in elements
        row = src[0].numel() if src.dim() > 0 and src.size(0) else 1
        splits = [n * row for n in input_split_sizes] if input_split_sizes else [src.numel() // self._comm.size] * self._comm.size
        self._run(Call(s.CollOp.ALLTOALL, [src], dst.numel(), src.dtype, into(dst), device=gpu_of(input), splits=splits))
        return self._done([output])

    all_to_all_single = alltoall_base

    @cpu_via_gloo
    @prof.profiled("nccl:all_to_all", "all_to_all", 1, 0)
    def alltoall(self, outputs, inputs, opts=None):
        srcs = [flat(t) for t in inputs]
        outs = [flat(t) for t in outputs]
        self._run(Call(s.CollOp.ALLTOALL, srcs, sum(o.numel() for o in outs), srcs[0].dtype, into_each(outs),
                       device=gpu_of(inputs[0]), splits=[t.numel() for t in srcs]))
        return self._done(outputs)

    @cpu_via_gloo
    @prof.profiled("nccl:all_reduce_coalesced", "allreduce_coalesced", 0)
    def allreduce_coalesced(self, tensors, opts=None):
        # one flat all-reduce over the concatenation, as NCCL's grouped calls amount to
        elems = [flat(t) for t in tensors]
        self._run(Call(s.CollOp.ALLREDUCE, elems, sum(e.numel() for e in elems), elems[0].dtype, into_each(elems),
                       device=gpu_of(tensors[0]), **reduction(opts)))
        return self._done(tensors)

    # the coalesced tensor forms (functional collectives, DTensor, FSDP2): one collective per pair,
    # in order, as NCCL's grouped calls amount to
    @cpu_via_gloo
    @prof.profiled("nccl:all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced", 1, 0)
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            elem = flat(inp)
            self._run(Call(s.CollOp.ALLGATHER, [elem], out.numel(), elem.dtype, into(flat(out)), device=gpu_of(inp)))
        return self._done(outputs)

    @cpu_via_gloo
    @prof.profiled("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", 1, 0)
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        red = reduction(opts)
        for out, inp in zip(outputs, inputs):
            elem = flat(inp)
            self._run(Call(s.CollOp.REDUCE_SCATTER, [elem], out.numel(), elem.dtype, into(flat(out)),
                           device=gpu_of(inp), **red))
        return self._done(outputs)

    # -- point to point: asynchronous, each message on its own
    def _p2p(self, op: s.CollOp, tensor: torch.Tensor, peer: int) -> P2PWork:
        if self._in_process:
            raise dist.DistBackendError(IN_PROCESS_MESSAGE)
        graphs.refuse_collective()
        elem = flat(tensor)
        key = (op, peer)
        self._p2p_seq[key] = n = self._p2p_seq.get(key, 0) + 1
        request = s.Collective(
            comm=self._comm.id, seq=n, rank=self._comm.rank, op=op, dtype=str(elem.dtype).removeprefix("torch."),
            numel=elem.numel(), out_numel=elem.numel(), device=RUNTIME.device.physical[gpu_of(tensor)], peer=peer,
            site=call_site(),
            t_ready=0.0 if RUNTIME.clock is None else RUNTIME.clock.collective_ready(gpu_of(tensor), self._comm.id),
        )
        deliver = None if op is s.CollOp.SEND else into(elem)
        return self._paths.p2p(elem).post_p2p(request, elem, deliver, gpu_of(tensor), tensor)

    @prof.profiled("nccl:send {rank}->{peer}", "send", 0)
    def send(self, tensors, dstRank, tag=0):
        return self._p2p(s.CollOp.SEND, tensors[0], dstRank)

    @prof.profiled("nccl:recv {rank}<-{peer}", "recv", 0)
    def recv(self, tensors, srcRank, tag=0):
        return self._p2p(s.CollOp.RECV, tensors[0], srcRank)

    # the names torch.distributed calls from Python for the tensor forms
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base

    @c10d_forms
    @prof.profiled("nccl:all_reduce", "barrier", 1)
    def barrier(self, opts=None):
        self._run(Call(s.CollOp.BARRIER, [], 0, torch.float32))
        return self._done([])
