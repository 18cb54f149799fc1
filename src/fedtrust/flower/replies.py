"""Flower replies read into what a fedtrust round needs, each one left out with the reason why.

A reply is usable as Flower's ``FedAvg`` expects it (``validate_message_reply_consistency``): no error,
exactly one MetricRecord holding the ``weighted_by_key`` count as a single number, and for training
exactly one ArrayRecord (whatever its key) that fits the global model. Where ``FedAvg`` ends the round
with ``InconsistentMessageReplies``, a :class:`TrustStrategy` drops the one reply and goes on.

A node names itself in an optional ConfigRecord ``fedtrust-node`` (``{"name": "hospital-a"}``, what
:func:`fedtrust.flower.trust_client_app` sends: its node config's ``node-name``, else
``partition-<partition-id>``); without one it is named by its Flower node id. A name is what an operator
reads in logs and reports. It is the node's own claim, so it keys trust only when the strategy is told
to (``identity="name"``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Message, MetricRecord, RecordDict

from fedtrust.flower.arrays import ArrayLayout, MalformedReply
from fedtrust.sim.store import is_number

#: The reply's ConfigRecord in which a node gives its name, and the longest name taken.
NODE_RECORD, NAME_LIMIT = "fedtrust-node", 64
#: Why a node messaged in a round and never heard from is left out of it.
NO_REPLY = "no reply before the round's timeout (the node may be hung, too slow, or gone without an error)"


@dataclass
class Reply:
    """A usable reply: who sent it, its metrics (numbers and lists of numbers), its content as received,
    and for training its model as a flat vector."""

    node: int
    name: str
    metrics: dict[str, Any]
    content: RecordDict
    vector: torch.Tensor | None = None

    def number(self, key: str) -> float:
        return float(self.metrics[key])


def reply_name(msg: Message) -> str:
    """The name the node gives in its ``fedtrust-node`` ConfigRecord, or its node id as text when it gives
    none (or one that is not a short printable string)."""
    record = msg.content.config_records.get(NODE_RECORD) if not msg.has_error() else None
    name = record.get("name") if record is not None else None
    if isinstance(name, str) and 0 < len(name) <= NAME_LIMIT and name.isprintable() and name.strip() == name:
        return name
    return str(msg.metadata.src_node_id)


def read_reply(
    msg: Message, weighted_by_key: str, required: Sequence[str] = (), layout: ArrayLayout | None = None
) -> Reply:
    """The reply as a :class:`Reply`; raises :class:`MalformedReply` saying what is wrong with it.
    ``required`` are metric keys that must hold a number; with a ``layout`` the reply's one ArrayRecord
    is flattened against it."""
    if msg.has_error():
        raise MalformedReply(f"the client reported an error: {msg.error.reason}")
    records = msg.content.metric_records
    if len(records) != 1:
        raise MalformedReply(f"expected one MetricRecord, got {len(records)} ({sorted(records)})")
    metrics = dict(next(iter(records.values())))
    for key in (weighted_by_key, *required):
        if key not in metrics:
            raise MalformedReply(f"metric {key!r} missing (has {sorted(metrics)})")
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedReply(f"metric {key!r} must be a number, got {value!r}")
    count = float(metrics[weighted_by_key])
    if not (math.isfinite(count) and count >= 0):
        raise MalformedReply(f"{weighted_by_key} must be a non-negative count, got {count!r}")
    vector = None
    if layout is not None:
        arrays = msg.content.array_records
        if len(arrays) != 1:
            raise MalformedReply(f"expected one ArrayRecord, got {len(arrays)} ({sorted(arrays)})")
        vector = layout.flatten(next(iter(arrays.values())))
    return Reply(msg.metadata.src_node_id, reply_name(msg), metrics, msg.content, vector)


def screen(
    replies: Iterable[Message],
    weighted_by_key: str,
    required: Sequence[str] = (),
    layout: ArrayLayout | None = None,
    by_name: bool = False,
    known: dict[int, str] | None = None,
    sent: Sequence[int] = (),
) -> tuple[list[Reply], dict[str, str]]:
    """The usable replies, and for each one left out its sender's name -> the reason (a reply without a
    name, e.g. an error, goes under the name its node gave last, in ``known``, else its node id). With
    ``by_name`` (trust keyed by names) a second reply under a name already taken this round is left
    out, and so is a node's second reply (one node is one client: trust is keyed by node ids).

    ``sent``: the nodes messaged this round. A reply from none of them is the SuperLink's on behalf of a
    node it could not reach ("Node Unavailable", sent from the SuperLink's own id): it goes under the
    node messaged that did not answer, or, with several such, under all their names. A node messaged
    that sent nothing back at all (no reply before the round's ``timeout``: hung, or too slow) is left out
    under its name too, with that reason."""
    replies = list(replies)
    answered = {msg.metadata.src_node_id for msg in replies}
    silent = [node for node in sent if node not in answered]
    accepted: list[Reply] = []
    dropped: dict[str, str] = {}
    taken: dict[str, int] = {}
    nodes: set[int] = set()
    stand_ins = 0  # replies the SuperLink sent for silent nodes
    for msg in replies:
        try:
            reply = read_reply(msg, weighted_by_key, required, layout)
            if reply.node in nodes:
                raise MalformedReply(f"node {reply.node} already replied this round")
            if by_name and reply.name in taken:
                raise MalformedReply(
                    f"name {reply.name!r} is already taken this round by node {taken[reply.name]}"
                )
        except MalformedReply as exc:
            node = msg.metadata.src_node_id
            name = reply_name(msg)
            name = (known or {}).get(node, name) if name == str(node) else name
            if sent and node not in sent and silent:  # the SuperLink's reply for a node it could not reach
                stand_ins += 1
                node, name = _silent_one(silent, known, dropped)
            dropped[_label(name, node, dropped)] = str(exc)
            continue
        taken[reply.name] = reply.node
        nodes.add(reply.node)
        accepted.append(reply)
    # the nodes that sent nothing: each by name, unless the SuperLink answered for some of them
    for k in range(len(silent) - stand_ins):
        node, name = _silent_one(silent if stand_ins else [silent[k]], known, dropped)
        dropped[_label(name, node, dropped)] = NO_REPLY
    return accepted, dropped


def _silent_one(silent: list[int], known: dict[int, str] | None, dropped: dict[str, str]) -> tuple[int, str]:
    """The node and name a drop for one of the ``silent`` nodes goes under: the node's own when it is the
    only one, else "one of <their names>" (numbered when that is taken already)."""
    names = [(known or {}).get(k, str(k)) for k in silent]
    if len(silent) == 1:
        return silent[0], names[0]
    name = f"one of {', '.join(names)}"  # which of them, nothing says
    return silent[0], (
        name if name not in dropped else f"{name} ({sum(k.startswith(name) for k in dropped) + 1})"
    )


def display_names(replies: Sequence[Reply]) -> list[str]:
    """One name per reply, unique within the round: a name two nodes claim gets the node id added."""
    seen: dict[str, int] = {}
    for r in replies:
        seen[r.name] = seen.get(r.name, 0) + 1
    return [r.name if seen[r.name] == 1 else f"{r.name} (node {r.node})" for r in replies]


def _label(name: str, node: int, taken: dict[str, str]) -> str:
    return name if name not in taken else f"{name} (node {node})"


def metric_groups(
    replies: Sequence[Reply], weighted_by_key: str, per_metric: bool = True
) -> tuple[list[list[RecordDict]], dict]:
    """The replies' contents in groups for Flower's metric aggregation, which needs every record it averages
    to hold the same keys in one form (a number, or a list of numbers of one length), and the metrics
    left out of some replies (metric -> their names).

    When the replies agree (the normal case) there is one group, the contents as received. Otherwise each
    metric is averaged over the replies that hold it in the form most of them give, when those are more
    than half the round (one node's odd or missing value does not take the metric from everyone, and a
    key one node adds is not the round's) and their ``weighted_by_key`` counts add up to more than 0; the
    metrics averaged over the same replies go as one group of contents cut to them and
    ``weighted_by_key``. Without ``per_metric`` (a user's aggregation function, which may combine
    metrics, or count its records) there is one group of every reply, cut to the metrics all of them
    hold in one form."""
    forms = [{k: _form(v) for k, v in r.metrics.items() if k != weighted_by_key} for r in replies]
    if all(f == forms[0] for f in forms) and None not in forms[0].values():
        return [[r.content for r in replies]], {}
    everyone = tuple(range(len(replies)))
    members: dict[tuple[int, ...], list[str]] = {} if per_metric else {everyone: []}
    left_out: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for f in forms for k in f):
        held = [f.get(key) for f in forms]
        counts = Counter(form for form in held if form is not None)
        form, most = max(counts.items(), key=lambda item: item[1], default=(None, 0))
        enough = most == len(replies) or (per_metric and 2 * most > len(replies))
        chosen = tuple(i for i, h in enumerate(held) if h == form) if enough else ()
        if sum(replies[i].number(weighted_by_key) for i in chosen) <= 0:  # nothing to weigh them by
            chosen = ()
        if len(chosen) < len(replies):
            left_out[key] = [r.name for i, r in enumerate(replies) if i not in chosen]
        if chosen:
            members.setdefault(chosen, []).append(key)
    groups = []
    for chosen, keys in members.items():
        contents = []
        for i in chosen:
            content = RecordDict(dict(replies[i].content.items()))
            (record_key,) = replies[i].content.metric_records
            metrics = replies[i].metrics
            content[record_key] = MetricRecord({k: metrics[k] for k in (weighted_by_key, *keys)})
            contents.append(content)
        groups.append(contents)
    return groups, left_out


def numbers_in_all(replies: Sequence[Reply], but: str) -> list[str]:
    """The metric keys every reply holds as a single number, ``but`` (the sample count) left out."""
    keys = set.intersection(*(set(r.metrics) for r in replies)) - {but}
    return sorted(k for k in keys if all(_form(r.metrics[k]) == "number" for r in replies))


def _form(value: Any) -> str | int | None:
    """``"number"``, a list's length, or None for anything Flower's aggregation cannot average."""
    if is_number(value):
        return "number"
    if isinstance(value, list) and all(map(is_number, value)):
        return len(value)
    return None
