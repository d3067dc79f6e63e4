"""Which peer a failed collective lost, read from the error torch raised.

Every rank records each rank's host and addresses when the run starts (:meth:`Peers.gather`).
When a collective fails because a peer is gone, gloo names the peer's address in its error
(``Connection closed by peer [10.0.0.2]:41235``, ``Read error [10.0.0.2]:41235: Connection
reset by peer``) or, for a peer that stopped answering, only the wait
(``Timed out waiting 600000ms for recv operation to complete``); torch raises the failures of
NCCL, of its store and of its network layer as ``torch.distributed.DistError``.
:meth:`Peers.lost` turns such an error into a :class:`LostPeer`; any other exception is not a
lost peer.

In a large job a rank may meet the failure second-hand: a rank that stopped because of a lost
peer closes its own connections, and the ranks still waiting on it name it. The first such
report of a job names the peer that was lost first.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

import psutil
import torch.distributed as dist

_GLOO_SOURCE = "/gloo/"  # gloo's errors start with the source file that raised them
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_REASONS = (  # what gloo or torch says -> a few words
    # A dead process's kernel closes or resets its connections, depending on timing.
    (re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe"), "its connection closed"),
    (re.compile(r"Timed out waiting (\d+)ms"), None),  # "no answer within N s", from the number
    (re.compile(r"No route to host|Network is unreachable"), "no route to it"),
)


@dataclass(frozen=True)
class LostPeer:
    """What a rank can tell about a peer it lost: the ranks (empty: unknown) and why."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Peers:
    """Every rank's host name and the addresses of its host, by rank."""

    hosts: tuple[str, ...]
    addresses: tuple[frozenset[str], ...]
    rank: int

    @classmethod
    def gather(cls) -> "Peers":
        """Collective: every rank's host and addresses (one small all-gather at start-up)."""
        mine = (socket.gethostname(), sorted(_local_addresses()))
        table: list = [None] * dist.get_world_size()
        dist.all_gather_object(table, mine)
        return cls(tuple(host for host, _ in table), tuple(frozenset(addrs) for _, addrs in table), dist.get_rank())

    def ranks_at(self, address: str) -> tuple[int, ...]:
        """The other ranks whose host has ``address``."""
        address = _normalized(address)
        return tuple(r for r, addrs in enumerate(self.addresses) if address in addrs and r != self.rank)

    def lost(self, error: BaseException) -> LostPeer | None:
        """The peer whose loss ``error`` reports, or None when ``error`` is not a lost peer."""
        if not is_lost_peer(error):
            return None
        message = str(error)
        ranks: tuple[int, ...] = ()
        if match := _PEER_ADDRESS.search(message):
            ranks = self.ranks_at(match.group(1))
        elif len(self.hosts) == 2:  # a timeout names no address; in a world of two it is the other rank
            ranks = (1 - self.rank,)
        hosts = tuple(dict.fromkeys(self.hosts[r] for r in ranks))
        return LostPeer(ranks, hosts, reason(message))


def is_lost_peer(error: BaseException) -> bool:
    """True for the errors torch raises when a peer of a collective is gone or silent."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and _GLOO_SOURCE in str(error).split("\n", 1)[0]


def describe(lost: LostPeer) -> str:
    """``rank 1 (host h2)``, ``ranks 8-15 (host gpu02)``, or ``a peer`` when unknown."""
    if not lost.ranks:
        return "a peer"
    ranks = sorted(lost.ranks)
    if len(ranks) == 1:
        who = f"rank {ranks[0]}"
    elif ranks == list(range(ranks[0], ranks[-1] + 1)):
        who = f"ranks {ranks[0]}-{ranks[-1]}"
    else:
        who = f"ranks {', '.join(map(str, ranks))}"
    return f"{who} (host {', '.join(lost.hosts)})"


def reason(message: str) -> str:
    """A few words for what went wrong with the peer."""
    for pattern, words in _REASONS:
        if match := pattern.search(message):
            return words or f"no answer within {int(match.group(1)) / 1000:g} s"
    first = message.split("\n", 1)[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[source.cc:123] " prefix
    return first[:160].rstrip(". ")


def _local_addresses() -> set[str]:
    """This host's IP addresses (IPv4 also in the IPv4-mapped IPv6 form a dual-stack socket reports)."""
    addresses = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addresses.add(_normalized(entry.address.split("%", 1)[0]))
    return addresses


def _normalized(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip)
