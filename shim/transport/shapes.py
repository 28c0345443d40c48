"""Estimate mode's data path: collectives of tensors without values, as requests alone."""

from __future__ import annotations

import dataclasses
import time

from shim.transport import stream
from shim.transport.stream import P2PWork, Pending
from shim.transport.transports import Call, Transport
from wire import schema as s


class ShapesTransport(Transport):
    """Estimate mode: the ranks' tensors hold no values, so a collective is its request alone. The daemon
    matches, books and times it as any other; the outputs keep the shapes they were made with."""

    def post(self, call: Call) -> Pending:
        request = call.request(self.comm, transport=s.Transport.SHAPES)
        req = self.comm.client.send(request)
        # with its deliverer, never called: the tensors it names are what later kernels wait for
        return stream.append(Pending(self, request, req, None, None, None, call.deliver, call.device,
                                     time.monotonic()))

    def complete(self, p: Pending) -> None:
        self.reply(p)  # and nothing to deliver: the outputs hold no values

    def post_p2p(self, request, elem, deliver, device, tensor) -> P2PWork:
        req = self.comm.client.send(dataclasses.replace(request, transport=s.Transport.SHAPES))
        return P2PWork(self, req, None, None, None, device, [tensor], request)
