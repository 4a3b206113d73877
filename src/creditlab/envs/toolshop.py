"""``toolshop``: a multi-turn tool-use world with a relational store and a terminal state verifier.

The world is in the style of retail agent benchmarks (users, orders, items, products with
variants, plus support tickets and cases that point at users). A task asks the agent to exchange an
item of a user's order for another variant of the same product. The final write's arguments
(order id, item id, variant id) are *not* in the instruction: they must be read through a chain of
tool calls, and the chain length ``C`` (2 to 8) is a task knob that decides where the chain starts:

=====  ==========================================  ===============================================
``C``  the instruction gives                       reads before the write ``exchange O I V``
=====  ==========================================  ===============================================
8      a case id, order status, category, colour   get_case, get_ticket, find_user, get_user,
                                                   get_order, get_item, get_product
7      a ticket id, status, category, colour       get_ticket, find_user, ... get_product
6      a user name, status, category, colour       find_user, get_user, get_order, get_item, ...
5      a user id, status, category, colour         get_user, get_order, get_item, get_product
4      an order id, category, colour               get_order, get_item, get_product
3      an order id, an item id, colour             get_item, get_product
2      order, item and product ids, colour         get_product
=====  ==========================================  ===============================================

Each read that returns alternatives lists ``attribute id`` pairs (``get_user`` -> ``status order``,
``get_order`` -> ``category item``, ``get_product`` -> ``colour variant``); the instruction's
attribute tells the agent which id it means. Three calls take an optional *guard*, the attribute the
agent expects (``get_order [status] O``, ``get_item [category] I``, ``exchange O I [colour] V``): a
mismatch is an error, so an agent that names what it selected gets its slips caught. Every store
is freshly generated from the task seed with random,
globally distinct ids, so nothing can be memorised across tasks: the ids must be read and copied.

Tools. Each tool is one :class:`Tool` record of :data:`TOOL_TABLE`: its argument names and kinds,
its optional guard, whether it writes, what a read returns, and its behaviour (a function of the
store and the parsed arguments). :data:`TOOLS` (and with it the vocabulary), the environment's
parser and :class:`ScriptedAgent` all read that table, so adding a tool is adding one record.

Tokens. The world speaks a small fixed vocabulary (:data:`VOCAB`). An episode is
``BOS TASK <instruction> SEP`` followed by turns; a turn is an *action* (the policy's tokens,
``tool arg ... EOA``) and the environment's *observation* ``OBS value ... EOO``. A malformed or
failing call gets ``OBS ERR EOO`` (never an exception) and changes nothing. A write that succeeds
(``OBS OK EOO``) ends the episode; so does the action budget (``max_turns``), in which case the
episode is *truncated*.

Thoughts. An action may carry free *thought* tokens (:data:`THOUGHT_TOKENS`, appended after
:data:`VOCAB` in :data:`VOCAB_WITH_THOUGHTS`, so no existing id moves): the environment drops them
before parsing, wherever they sit, so they change no tool call and no verdict. A policy whose
actions think has :func:`vocab_size` ``(m)`` outputs; :class:`ScriptedAgent` with ``thoughts = m``
starts every action with ``m`` uniformly random thoughts (high entropy by construction, as an LLM
agent's free text keeps its entropy while its tool calls become deterministic).

Verifier. :func:`verify` compares the final store with the goal store field by field: the target
item's variant, the target item's status, and "no other item changed". ``success`` is all three;
``progress`` is the fraction that hold. Only the write step changes the store, so a state-diff
verifier sees one of the ``C`` causal steps: the world's write fraction and verifier density are
both ``1 / C`` (:func:`world_stats`).

Each turn is kept as a :class:`TurnRecord` with ``name``, ``arguments``, ``returned`` and
``is_write``, so :func:`creditlab.core.diagnostics.chain_length` measures ``C`` by dataflow.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from creditlab.errors import ConfigError, InputError

__all__ = [
    "ATTRIBUTE_TOKENS",
    "CATEGORIES",
    "COLORS",
    "MAX_CHAIN",
    "MIN_CHAIN",
    "MULTI_EXCHANGE",
    "MultiScriptedAgent",
    "MultiTask",
    "make_multi_task",
    "verify_multi",
    "N_IDS",
    "N_THOUGHTS",
    "NAMES",
    "READ_TOOLS",
    "STATUSES",
    "TOOLS",
    "THOUGHT0",
    "THOUGHT_TOKENS",
    "TOOL_TABLE",
    "TOK",
    "VOCAB",
    "VOCAB_WITH_THOUGHTS",
    "WRITE_TOOLS",
    "Store",
    "Task",
    "Tool",
    "ToolError",
    "ToolshopEnv",
    "TurnRecord",
    "decode",
    "encode",
    "is_thought",
    "make_store",
    "make_task",
    "ScriptedAgent",
    "run_scripted",
    "tool_chain",
    "thought_mask",
    "trajectory_stats",
    "verify",
    "vocab_size",
    "world_stats",
]

MIN_CHAIN, MAX_CHAIN = 2, 8
N_IDS = 128
STATUSES = ("pending", "delivered")
CATEGORIES = ("shirt", "lamp", "mug", "shoe", "desk", "bag")
COLORS = ("red", "blue", "green", "black", "white", "gray")
NAMES = ("ann", "bob", "cyd", "dan", "eve", "fay", "gus", "hal", "ida", "jon", "kim", "lee")


# ----------------------------------------------------------------------------------------------
# Tools: one record per tool (its signature, its optional guard, what it returns, what it does)
# ----------------------------------------------------------------------------------------------


class ToolError(Exception):
    """Raised by a tool's behaviour when the call fails; the turn records the message as its error
    and observes ``OBS ERR EOO`` (it never leaves :meth:`ToolshopEnv.step`)."""


@dataclass(frozen=True)
class Tool:
    """One tool of the world. Adding a tool is adding one record to :data:`TOOL_TABLE` (its name
    becomes a token of :data:`VOCAB`, so ids after it shift).

    A call is ``name arg ...``: one token per argument, an ``"id"`` (a number) or a ``"name"`` (one
    of :data:`NAMES`), plus the optional guard, an attribute token at position ``guard_pos`` of the
    arguments. ``call(store, arguments)`` is the behaviour: ``arguments`` maps ``arg_names`` (and
    ``guard``, when given) to the parsed values, as the turn's :class:`TurnRecord` keeps them; it
    returns the observed values (``[]`` for a write) or raises :class:`ToolError`.

    ``returns`` and ``listed_by`` describe the dataflow of a correct episode: a read returns the id
    of the entity ``returns`` (the argument of the next tool of :func:`tool_chain`); when it lists
    ``attribute id`` alternatives, ``listed_by`` is the attribute (a :class:`Task` field and the
    next tool's guard) that tells which id the task means. :class:`ScriptedAgent` plays from them.
    """

    name: str
    arg_names: tuple[str, ...]
    """Argument names, in call order (the keys of ``TurnRecord.arguments``)."""
    arg_kinds: tuple[str, ...]
    """``"id"`` or ``"name"`` for each argument."""
    call: Callable[[Store, dict[str, object]], list[object]]
    """The behaviour: ``call(store, arguments) -> returned values``; raises :class:`ToolError`."""
    guard: str | None = None
    """The attribute an optional guard names (``status``, ``category``, ``color``); a mismatch fails."""
    guard_pos: int = 0
    """Where the optional guard sits among the arguments."""
    is_write: bool = False
    """A write changes the store; a successful one ends the episode (observation ``OK``)."""
    returns: str | None = None
    """The entity whose id a read returns (``None`` for the write)."""
    listed_by: str | None = None
    """For reads returning ``attribute id`` pairs: the attribute that selects the id."""

    @property
    def arity(self) -> int:
        """Number of arguments, without the optional guard."""
        return len(self.arg_names)


def _row(table: dict, key: object, what: str):
    if key not in table:
        raise ToolError(f"{what} {key} not found")
    return table[key]


def _get_case(st: Store, a: dict[str, object]) -> list[object]:
    return [_row(st.cases, a["case"], "case")]


def _get_ticket(st: Store, a: dict[str, object]) -> list[object]:
    return [_row(st.tickets, a["ticket"], "ticket")]


def _find_user(st: Store, a: dict[str, object]) -> list[object]:
    u = st.user_by_name(str(a["name"]))
    if u is None:
        raise ToolError(f"name {a['name']} not found")
    return [u]


def _get_user(st: Store, a: dict[str, object]) -> list[object]:
    user = _row(st.users, a["user"], "user")
    return [v for o in user["orders"] for v in (st.orders[o]["status"], o)]


def _get_order(st: Store, a: dict[str, object]) -> list[object]:
    order = _row(st.orders, a["order"], "order")
    if "status" in a and order["status"] != a["status"]:
        raise ToolError(f"order {a['order']} is not {a['status']}")
    return [v for i in order["items"] for v in (st.products[st.items[i]["product"]]["category"], i)]


def _get_item(st: Store, a: dict[str, object]) -> list[object]:
    item = _row(st.items, a["item"], "item")
    if "category" in a and st.products[item["product"]]["category"] != a["category"]:
        raise ToolError(f"item {a['item']} is not a {a['category']}")
    return [item["product"]]


def _get_product(st: Store, a: dict[str, object]) -> list[object]:
    product = _row(st.products, a["product"], "product")
    return [v for w in product["variants"] for v in (st.variants[w]["color"], w)]


def _exchange(st: Store, a: dict[str, object]) -> list[object]:
    o, i, v = a["order"], a["item"], a["variant"]
    if "color" in a and v in st.variants and st.variants[v]["color"] != a["color"]:
        raise ToolError(f"variant {v} is not {a['color']}")
    if o not in st.orders or i not in st.orders[o]["items"]:
        raise ToolError(f"item {i} is not in order {o}")
    if v not in st.products[st.items[i]["product"]]["variants"]:
        raise ToolError(f"variant {v} is not a variant of item {i}'s product")
    if st.items[i]["status"] != "ordered":
        raise ToolError(f"item {i} was already exchanged")
    st.items[i]["variant"] = v
    st.items[i]["status"] = "exchanged"
    return []


#: The tools, in chain order: each read's (selected) output is the next tool's argument.
TOOL_TABLE: dict[str, Tool] = {t.name: t for t in (
    Tool("get_case", ("case",), ("id",), _get_case, returns="ticket"),
    Tool("get_ticket", ("ticket",), ("id",), _get_ticket, returns="name"),
    Tool("find_user", ("name",), ("name",), _find_user, returns="user"),
    Tool("get_user", ("user",), ("id",), _get_user, returns="order", listed_by="status"),
    Tool("get_order", ("order",), ("id",), _get_order, guard="status", returns="item", listed_by="category"),
    Tool("get_item", ("item",), ("id",), _get_item, guard="category", returns="product"),
    Tool("get_product", ("product",), ("id",), _get_product, returns="variant", listed_by="color"),
    Tool("exchange", ("order", "item", "variant"), ("id", "id", "id"), _exchange, guard="color", guard_pos=2,
         is_write=True),
)}
TOOLS: tuple[str, ...] = tuple(TOOL_TABLE)
READ_TOOLS = tuple(n for n, t in TOOL_TABLE.items() if not t.is_write)
WRITE_TOOLS = tuple(n for n, t in TOOL_TABLE.items() if t.is_write)
SPECIALS = ("<pad>", "<bos>", "TASK", "SEP", "EOA", "OBS", "EOO", "ERR", "OK")
MARKERS = ("case", "ticket", "name", "user", "order", "item", "product")
ATTRIBUTE_TOKENS = STATUSES + CATEGORIES + COLORS
VOCAB: tuple[str, ...] = (SPECIALS + TOOLS + MARKERS + ATTRIBUTE_TOKENS + NAMES
                          + tuple(str(i) for i in range(N_IDS)))
#: Reward-neutral "thought" tokens an action may carry (:data:`VOCAB_WITH_THOUGHTS`): appended after
#: :data:`VOCAB`, so no existing id moves; a policy without thoughts has ``len(VOCAB)`` outputs.
N_THOUGHTS = 16
THOUGHT_TOKENS: tuple[str, ...] = tuple(f"think{i}" for i in range(N_THOUGHTS))
VOCAB_WITH_THOUGHTS: tuple[str, ...] = VOCAB + THOUGHT_TOKENS
TOK: dict[str, int] = {t: i for i, t in enumerate(VOCAB_WITH_THOUGHTS)}
PAD, BOS, EOA, EOO = TOK["<pad>"], TOK["<bos>"], TOK["EOA"], TOK["EOO"]
_ID0 = TOK["0"]
THOUGHT0 = len(VOCAB)
"""The id of the first thought token: ids ``THOUGHT0 .. THOUGHT0 + N_THOUGHTS - 1`` are thoughts."""


def vocab_size(thoughts: int = 0) -> int:
    """Outputs of a toolshop policy: ``len(VOCAB)``, plus :data:`N_THOUGHTS` when its actions carry
    ``thoughts > 0`` thought tokens."""
    return len(VOCAB) + (N_THOUGHTS if thoughts > 0 else 0)


def is_thought(token_id: int) -> bool:
    """Whether ``token_id`` is a thought token (reward-neutral: :class:`ToolshopEnv` drops it)."""
    return THOUGHT0 <= token_id < THOUGHT0 + N_THOUGHTS


def thought_mask(ids):
    """Elementwise :func:`is_thought` of an array of ids (a torch tensor or a numpy array)."""
    return (ids >= THOUGHT0) & (ids < THOUGHT0 + N_THOUGHTS)

def encode(tokens: Sequence[str | int]) -> list[int]:
    """Token strings (ints are id numbers) to token ids; raises :class:`InputError` on unknowns."""
    out = []
    for t in tokens:
        s = str(t)
        if s not in TOK:
            raise InputError(f"tokens: {s!r} is not in the toolshop vocabulary")
        out.append(TOK[s])
    return out


def decode(ids: Sequence[int]) -> list[str]:
    """Token ids to token strings (out-of-range ids raise :class:`InputError`)."""
    out = []
    for i in ids:
        i = int(i)
        if not 0 <= i < len(VOCAB_WITH_THOUGHTS):
            raise InputError(f"ids: {i} is outside the vocabulary of size {len(VOCAB_WITH_THOUGHTS)}")
        out.append(VOCAB_WITH_THOUGHTS[i])
    return out


def tool_chain(chain_length: int) -> tuple[str, ...]:
    """The tools a correct episode calls, in order, for chain length ``C`` (the last is the write).

    >>> tool_chain(4)
    ('get_order', 'get_item', 'get_product', 'exchange')
    >>> " ".join(make_task(0, 4).instruction)
    'order 8 bag black'
    """
    if not MIN_CHAIN <= int(chain_length) <= MAX_CHAIN:
        raise ConfigError("chain_length", f"must be in [{MIN_CHAIN}, {MAX_CHAIN}], got {chain_length}")
    return TOOLS[len(TOOLS) - int(chain_length):]


# ----------------------------------------------------------------------------------------------
# Store and tasks
# ----------------------------------------------------------------------------------------------


@dataclass
class Store:
    """The relational store. Ids are ints, globally distinct across tables within one store.

    ``cases[k] = ticket``; ``tickets[t] = name``; ``users[u] = {"name", "orders"}``;
    ``orders[o] = {"user", "status", "items"}``; ``items[i] = {"order", "product", "variant",
    "status"}``; ``products[p] = {"category", "variants"}``; ``variants[v] = {"product", "color"}``.
    """

    cases: dict[int, int] = field(default_factory=dict)
    tickets: dict[int, str] = field(default_factory=dict)
    users: dict[int, dict] = field(default_factory=dict)
    orders: dict[int, dict] = field(default_factory=dict)
    items: dict[int, dict] = field(default_factory=dict)
    products: dict[int, dict] = field(default_factory=dict)
    variants: dict[int, dict] = field(default_factory=dict)

    def copy(self) -> Store:
        """A deep copy (records are flat dicts whose list values are copied too)."""
        def rows(table: dict[int, dict]) -> dict[int, dict]:
            return {k: {f: (list(v) if isinstance(v, list) else v) for f, v in rec.items()}
                    for k, rec in table.items()}
        return Store(dict(self.cases), dict(self.tickets), rows(self.users), rows(self.orders),
                     rows(self.items), rows(self.products), rows(self.variants))

    def user_by_name(self, name: str) -> int | None:
        for u, rec in self.users.items():
            if rec["name"] == name:
                return u
        return None


def make_store(seed: int, *, n_users: int = 3, orders_per_user: int = 2,
               items_per_order: tuple[int, int] = (2, 3), variants_per_product: tuple[int, int] = (2, 3)
               ) -> Store:
    """A fresh store from ``seed``: ``n_users`` users, each with one order per status, each order with
    items of distinct categories, each item's product with variants of distinct colours."""
    if not 1 <= n_users <= len(NAMES):
        raise ConfigError("n_users", f"must be in [1, {len(NAMES)}], got {n_users}")
    if not 1 <= orders_per_user <= len(STATUSES):
        raise ConfigError("orders_per_user", f"must be in [1, {len(STATUSES)}], got {orders_per_user}")
    rng = random.Random(seed)
    ids = list(range(N_IDS))
    rng.shuffle(ids)
    pool = iter(ids)

    def new_id() -> int:
        try:
            return next(pool)
        except StopIteration:
            raise ConfigError("make_store", f"store needs more than {N_IDS} ids; make it smaller") from None

    st = Store()
    for name in rng.sample(NAMES, n_users):
        u = new_id()
        st.users[u] = {"name": name, "orders": []}
        t, k = new_id(), new_id()
        st.tickets[t] = name
        st.cases[k] = t
        for status in rng.sample(STATUSES, orders_per_user):
            o = new_id()
            st.orders[o] = {"user": u, "status": status, "items": []}
            st.users[u]["orders"].append(o)
            for cat in rng.sample(CATEGORIES, rng.randint(*items_per_order)):
                p = new_id()
                colors = rng.sample(COLORS, rng.randint(*variants_per_product))
                st.products[p] = {"category": cat, "variants": []}
                for col in colors:
                    v = new_id()
                    st.variants[v] = {"product": p, "color": col}
                    st.products[p]["variants"].append(v)
                i = new_id()
                st.items[i] = {"order": o, "product": p, "variant": rng.choice(st.products[p]["variants"]),
                               "status": "ordered"}
                st.orders[o]["items"].append(i)
    return st


@dataclass(frozen=True)
class Task:
    """One task: the store it runs on (initial state), the instruction and the goal write."""

    seed: int
    chain_length: int
    store: Store
    instruction: tuple[str, ...]   # instruction tokens (between TASK and SEP)
    given: tuple[str, ...]         # the values the instruction contains (for chain_length)
    order: int
    item: int
    variant: int
    user: int
    status: str
    category: str
    color: str

    @property
    def prompt_ids(self) -> list[int]:
        """``BOS TASK <instruction> SEP`` as token ids."""
        return encode(("<bos>", "TASK", *self.instruction, "SEP"))

    def goal_store(self) -> Store:
        st = self.store.copy()
        st.items[self.item]["variant"] = self.variant
        st.items[self.item]["status"] = "exchanged"
        return st


def make_task(seed: int, chain_length: int = 4, **store_kwargs) -> Task:
    """A deterministic task from ``seed``; ``chain_length`` in [2, 8] is ``C`` (see module doc)."""
    tool_chain(chain_length)  # validates
    C = int(chain_length)
    st = make_store(seed, **store_kwargs)
    rng = random.Random(f"task-{seed}")
    u = rng.choice(sorted(st.users))
    o = rng.choice(st.users[u]["orders"])
    i = rng.choice(st.orders[o]["items"])
    p = st.items[i]["product"]
    others = [v for v in st.products[p]["variants"] if v != st.items[i]["variant"]]
    v = rng.choice(others)
    status, cat, color = st.orders[o]["status"], st.products[p]["category"], st.variants[v]["color"]
    name = st.users[u]["name"]
    ticket = next(t for t, n in st.tickets.items() if n == name)
    case = next(k for k, t in st.cases.items() if t == ticket)
    head: dict[int, tuple[str, ...]] = {
        8: ("case", str(case), status, cat), 7: ("ticket", str(ticket), status, cat),
        6: ("name", name, status, cat), 5: ("user", str(u), status, cat), 4: ("order", str(o), cat),
        3: ("order", str(o), "item", str(i)), 2: ("order", str(o), "item", str(i), "product", str(p)),
    }
    instruction = (*head[C], color)
    given = tuple(t for t in instruction if t not in MARKERS)
    return Task(seed=seed, chain_length=C, store=st, instruction=instruction, given=given, order=o,
                item=i, variant=v, user=u, status=status, category=cat, color=color)


#: The task code of a multi-exchange task in a list of chain lengths (``make_tasks``): an episode of
#: 3 or 4 independent exchanges on one store (:func:`make_multi_task`).
MULTI_EXCHANGE = 0
#: Sub-tasks per multi-exchange task, and their chain lengths (each sub-task draws one).
MULTI_SUBTASKS, MULTI_SUB_CHAINS = (3, 4), (2, 3, 4)


@dataclass(frozen=True)
class MultiTask:
    """A task of several independent exchanges on one store: ``subtasks`` (each a :class:`Task` on
    :attr:`store`, distinct target items), asked one after the other in one prompt,
    ``BOS TASK <instruction 1> TASK <instruction 2> ... SEP``. A successful write completes one
    exchange; the episode ends after ``len(subtasks)`` successful writes or the action budget,
    twice that of a single task (``2 (C + 2)``, ``C`` the calls of a correct episode). Its outcome
    is graded: the share of sub-tasks solved (:func:`verify`)."""

    seed: int
    chain_length: int              # tool calls of a correct episode (sum over the sub-tasks)
    store: Store
    instruction: tuple[str, ...]   # the sub-tasks' instructions, separated by TASK
    given: tuple[str, ...]         # the values the instructions contain
    subtasks: tuple[Task, ...]

    @property
    def prompt_ids(self) -> list[int]:
        """``BOS TASK <instruction 1> TASK ... SEP`` as token ids."""
        return encode(("<bos>", "TASK", *self.instruction, "SEP"))

    @property
    def n_writes(self) -> int:
        """Successful writes that end the episode (one per sub-task)."""
        return len(self.subtasks)

    @property
    def turn_budget(self) -> int:
        """The default action budget: ``2 (C + 2)``."""
        return 2 * (self.chain_length + 2)

    def goal_store(self) -> Store:
        st = self.store.copy()
        for t in self.subtasks:
            st.items[t.item]["variant"] = t.variant
            st.items[t.item]["status"] = "exchanged"
        return st


def make_multi_task(seed: int, n_subtasks: int | None = None, sub_chains: Sequence[int] = MULTI_SUB_CHAINS
                    ) -> MultiTask:
    """A deterministic multi-exchange task from ``seed``: ``n_subtasks`` (default: 3 or 4, seeded)
    exchanges of distinct items of one store, each sub-task with a chain length drawn from
    ``sub_chains`` (the instruction of :func:`make_task` for that length)."""
    rng = random.Random(f"multi-{seed}")
    K = int(n_subtasks) if n_subtasks is not None else rng.choice(MULTI_SUBTASKS)
    st = make_store(seed)
    if not 1 <= K <= len(st.items):
        raise ConfigError("n_subtasks", f"must be in [1, {len(st.items)}], got {n_subtasks}")
    subs = []
    for i in rng.sample(sorted(st.items), K):
        C = int(rng.choice(tuple(sub_chains)))
        tool_chain(C)  # validates
        o, p = st.items[i]["order"], st.items[i]["product"]
        u = st.orders[o]["user"]
        v = rng.choice([w for w in st.products[p]["variants"] if w != st.items[i]["variant"]])
        status, cat, color = st.orders[o]["status"], st.products[p]["category"], st.variants[v]["color"]
        name = st.users[u]["name"]
        ticket = next(t for t, n in st.tickets.items() if n == name)
        case = next(k for k, t in st.cases.items() if t == ticket)
        head = {8: ("case", str(case), status, cat), 7: ("ticket", str(ticket), status, cat),
                6: ("name", name, status, cat), 5: ("user", str(u), status, cat), 4: ("order", str(o), cat),
                3: ("order", str(o), "item", str(i)), 2: ("order", str(o), "item", str(i), "product", str(p))}[C]
        inst = (*head, color)
        subs.append(Task(seed=seed, chain_length=C, store=st, instruction=inst,
                         given=tuple(t for t in inst if t not in MARKERS), order=o, item=i, variant=v, user=u,
                         status=status, category=cat, color=color))
    instruction = tuple(t for j, s in enumerate(subs) for t in ((("TASK",) if j else ()) + s.instruction))
    given = tuple(dict.fromkeys(g for s in subs for g in s.given))
    return MultiTask(seed=seed, chain_length=sum(s.chain_length for s in subs), store=st, instruction=instruction,
                     given=given, subtasks=tuple(subs))


# ----------------------------------------------------------------------------------------------
# Verifier
# ----------------------------------------------------------------------------------------------


def verify(store: Store, task: Task) -> tuple[bool, float]:
    """Terminal state verifier: ``(success, progress)`` of ``store`` against the task's goal.

    Fields: target item's variant == goal variant; target item's status == "exchanged"; every
    other item unchanged. ``progress`` = fraction of the three that hold; ``success`` = all hold.
    A :class:`MultiTask` is graded (:func:`verify_multi`): ``success`` is the share of sub-tasks solved.
    """
    if isinstance(task, MultiTask):
        return verify_multi(store, task)
    start = task.store.items  # the goal store equals the start store except on the target item
    tgt = store.items.get(task.item, {})
    f_variant = tgt.get("variant") == task.variant
    f_status = tgt.get("status") == "exchanged"
    f_others = all(store.items.get(i) == rec for i, rec in start.items() if i != task.item) \
        and set(store.items) == set(start)
    fields = (f_variant, f_status, f_others)
    return all(fields), sum(fields) / len(fields)


def verify_multi(store: Store, task: MultiTask) -> tuple[float, float]:
    """``(share solved, progress)`` of a :class:`MultiTask`: a sub-task is solved when its item holds
    the goal variant and is exchanged; ``progress`` = the fraction of the ``2 K + 1`` fields that
    hold (each sub-task's variant and status, and "no other item changed")."""
    targets = {t.item for t in task.subtasks}
    solved, fields = 0, 0
    for t in task.subtasks:
        rec = store.items.get(t.item, {})
        f_variant, f_status = rec.get("variant") == t.variant, rec.get("status") == "exchanged"
        solved += f_variant and f_status
        fields += f_variant + f_status
    f_others = all(store.items.get(i) == rec for i, rec in task.store.items.items() if i not in targets) \
        and set(store.items) == set(task.store.items)
    K = len(task.subtasks)
    return solved / K, (fields + f_others) / (2 * K + 1)


def trajectory_stats(records: Sequence[TurnRecord]) -> dict[str, float]:
    """Measured on one trajectory: tool calls, write fraction (writes / calls), error rate."""
    n = len(records)
    return {"tool_calls": float(n),
            "write_fraction": sum(r.is_write for r in records) / n if n else 0.0,
            "error_rate": sum(not r.ok for r in records) / n if n else 0.0}


def world_stats(chain_length: int) -> dict[str, float]:
    """Analytic fingerprints of a correct episode of chain length ``C``: one write among ``C`` calls.

    ``write_fraction = 1/C``; the state-diff verifier can judge only the write step, so
    ``verifier_density = k / C = 1/C`` (it reaches the write-fraction ceiling).
    """
    C = len(tool_chain(chain_length))
    return {"chain_length": float(C), "write_fraction": 1.0 / C, "verifier_density": 1.0 / C}


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    """One turn: the call as parsed, what it returned, whether it wrote. Fields match what
    :func:`creditlab.core.diagnostics.chain_length` reads."""

    name: str                      # tool name, or "<malformed>"
    arguments: dict[str, object]   # argument name -> value (ints for ids, str for names)
    returned: list[object]         # values returned (empty on error)
    is_write: bool                 # True only for a write that changed the store
    ok: bool                       # False on a malformed or failing call
    error: str = ""                # why it failed
    action: tuple[int, ...] = ()   # the action's token ids (without EOA)
    observation: tuple[int, ...] = ()  # the observation's token ids


@dataclass
class StepResult:
    observation: list[int]
    done: bool
    record: TurnRecord


class ToolshopEnv:
    """One episode of a task. ``reset()`` gives the prompt ids; ``step(action_ids)`` runs one call.

    Never raises on a bad action: the error becomes an ``OBS ERR EOO`` observation.
    """

    def __init__(self, task: Task, max_turns: int | None = None):
        self.task = task
        self.max_turns = int(max_turns) if max_turns is not None else getattr(task, "turn_budget",
                                                                                task.chain_length + 2)
        if self.max_turns < 1:
            raise ConfigError("max_turns", f"must be >= 1, got {max_turns}")
        self.store: Store | None = None
        self.reset()

    def reset(self) -> list[int]:
        if self.store is None or self.records:
            self.store = self.task.store.copy()
        self.records: list[TurnRecord] = []
        self.done = False
        self.wrote = False
        return self.task.prompt_ids

    @property
    def truncated(self) -> bool:
        """True when the action budget ended the episode before a successful write."""
        return self.done and not self.wrote

    def result(self) -> tuple[bool, float]:
        return verify(self.store, self.task)

    def step(self, action: Sequence[int]) -> StepResult:
        if self.done:
            raise InputError("step: the episode is over; call reset()")
        action = [int(a) for a in action]
        if action and action[-1] == EOA:
            action = action[:-1]
        rec = self._call(action)
        obs = ["OBS", *(("ERR",) if not rec.ok else ("OK",) if rec.is_write else rec.returned), "EOO"]
        rec.observation = tuple(encode(obs))
        self.records.append(rec)
        if rec.is_write and sum(r.is_write for r in self.records) >= getattr(self.task, "n_writes", 1):
            self.wrote = True  # every exchange asked for went through (one for a single task)
            self.done = True
        elif len(self.records) >= self.max_turns:
            self.done = True
        return StepResult(list(rec.observation), self.done, rec)

    def _call(self, action: list[int]) -> TurnRecord:
        # thought tokens are reward-neutral: dropped wherever they sit, before parsing
        toks = [VOCAB[a] if 0 <= a < len(VOCAB) else "?" for a in action if not is_thought(a)]

        def fail(name: str, msg: str, arguments: dict | None = None) -> TurnRecord:
            return TurnRecord(name, arguments or {}, [], False, False, msg, tuple(action))

        tool = TOOL_TABLE.get(toks[0]) if toks else None
        if tool is None:
            return fail("<malformed>", "action does not start with a tool name")
        args = toks[1:]
        # an optional guard: the attribute the agent expects the entity to have
        guard = None
        if tool.guard is not None and len(args) == tool.arity + 1 and args[tool.guard_pos] in ATTRIBUTE_TOKENS:
            guard = args.pop(tool.guard_pos)
        if len(args) != tool.arity:
            return fail(tool.name, f"{tool.name} takes {tool.arity} argument(s), got {len(args)}")
        values: list[object] = []
        for a, kind in zip(args, tool.arg_kinds, strict=True):
            if kind == "id":
                if not a.isdigit():
                    return fail(tool.name, f"argument {a!r} is not an id")
                values.append(int(a))
            else:
                if a not in NAMES:
                    return fail(tool.name, f"argument {a!r} is not a name")
                values.append(a)
        arguments: dict[str, object] = dict(zip(tool.arg_names, values, strict=True))
        if guard is not None:
            arguments[tool.guard] = guard
        try:
            returned = tool.call(self.store, arguments)
        except ToolError as e:
            return fail(tool.name, str(e), arguments)
        return TurnRecord(tool.name, arguments, returned, tool.is_write, True, "", tuple(action))


# ----------------------------------------------------------------------------------------------
# Scripted (noisy) demonstrator
# ----------------------------------------------------------------------------------------------


def _select(returned: list[object], want: str, rng: random.Random, noise: float) -> tuple[object, object]:
    """From ``[attr, id, attr, id, ...]`` pick ``(id, attr)`` with attr ``want`` (a wrong pair w.p. noise)."""
    pairs = [(returned[j + 1], returned[j]) for j in range(0, len(returned) - 1, 2)]
    right = [p for p in pairs if p[1] == want]
    wrong = [p for p in pairs if p[1] != want]
    if wrong and (not right or rng.random() < noise):
        return rng.choice(wrong)
    return right[0]


class ScriptedAgent:
    """A scripted agent for one episode; ``act(last_record)`` gives its next action (token strings,
    ``EOA`` included).

    With ``noise = 0`` it solves every task in exactly ``C`` turns. With ``noise > 0`` each choice
    among returned alternatives is wrong with probability ``noise``, and each action is replaced by a
    malformed one with probability ``noise / 4`` (after which it simply retries); it never corrects a
    wrong choice, so a wrong read propagates to the write, as a careless agent's would.
    """

    def __init__(self, task: Task, rng: random.Random, noise: float = 0.0, thoughts: int = 0,
                 thought_rng: random.Random | None = None):
        if thoughts < 0:
            raise ConfigError("thoughts", f"must be >= 0, got {thoughts}")
        self.task, self.rng, self.noise = task, rng, float(noise)
        self.thoughts = int(thoughts)
        self.thought_rng = thought_rng if thought_rng is not None else random.Random(f"thoughts/{task.instruction}")
        self.chain = tool_chain(task.chain_length)
        self.stage = 0
        inst = dict(zip(task.instruction[::2], task.instruction[1::2], strict=False))
        self.known: dict[str, object] = {}
        for key in MARKERS:
            if key in inst:
                self.known[key] = inst[key] if key == "name" else int(inst[key])

    def act(self, last: TurnRecord | None = None) -> list[str]:
        task, rng, noise, known = self.task, self.rng, self.noise, self.known
        if last is not None and last.ok:  # a read went through: remember what it returned
            self.stage += 1
            done = TOOL_TABLE[last.name]
            if done.listed_by is not None:
                known[done.returns], known[done.listed_by] = _select(
                    last.returned, getattr(task, done.listed_by), rng, noise)
            elif done.returns is not None:
                known[done.returns] = last.returned[0]
        think = [self.thought_rng.choice(THOUGHT_TOKENS) for _ in range(self.thoughts)]
        if rng.random() < noise / 4:
            junk = rng.choice([[WRITE_TOOLS[0], str(task.order)], [rng.choice(READ_TOOLS)], ["EOO"]])
            return [*think, *junk, "EOA"]
        tool = TOOL_TABLE[self.chain[min(self.stage, len(self.chain) - 1)]]
        args = [known.get(n) for n in tool.arg_names]
        if tool.guard is not None:  # the attribute the id was selected by (only when selected from a list)
            args.insert(tool.guard_pos, known.get(tool.guard))
        return [*think, tool.name, *(str(a) for a in args if a is not None), "EOA"]


class MultiScriptedAgent:
    """The scripted agent of a :class:`MultiTask`: a :class:`ScriptedAgent` per sub-task, one after
    the other. After a successful write it starts the next sub-task; after a failed write (its
    selections were wrong) it leaves that sub-task for later and starts it again from its
    instruction once the others are done, as an agent that notices a failed exchange would."""

    def __init__(self, task: MultiTask, rng: random.Random, noise: float = 0.0, thoughts: int = 0,
                 thought_rng: random.Random | None = None):
        self.task, self.rng, self.noise, self.thoughts = task, rng, float(noise), int(thoughts)
        self.thought_rng = thought_rng if thought_rng is not None else random.Random(f"thoughts/{task.instruction}")
        self.pending = list(task.subtasks)
        self.agent = self._start()
        self.wrote = False  # the last action was the current sub-task's write (not a malformed one)

    def _start(self) -> ScriptedAgent | None:
        if not self.pending:
            return None
        return ScriptedAgent(self.pending[0], self.rng, self.noise, thoughts=self.thoughts,
                             thought_rng=self.thought_rng)

    def act(self, last: TurnRecord | None = None) -> list[str]:
        if self.wrote and last is not None:
            done = self.pending.pop(0)
            if not last.ok:  # a failed exchange: try that sub-task again after the others
                self.pending.append(done)
            self.agent, last = self._start(), None
        if self.agent is None:  # nothing left to do (the budget ends the episode)
            self.agent, self.pending = self._start(), list(self.task.subtasks)
        action = self.agent.act(last)
        calls = [t for t in action if t not in THOUGHT_TOKENS]
        self.wrote = calls[0] in WRITE_TOOLS and len(calls) > TOOL_TABLE[calls[0]].arity
        return action


def run_scripted(task: Task, seed: int, noise: float = 0.0, max_turns: int | None = None, thoughts: int = 0
                 ) -> tuple[list[int], list[bool], ToolshopEnv]:
    """Play one episode with :class:`ScriptedAgent`; returns (token ids, policy mask, finished env).
    With ``thoughts = m > 0`` every action starts with ``m`` thought tokens drawn uniformly (from a
    generator of their own, so the demonstrator's choices are those of ``thoughts = 0``)."""
    env = ToolshopEnv(task, max_turns)
    ids = env.reset()
    mask = [False] * len(ids)
    agent = (MultiScriptedAgent if isinstance(task, MultiTask) else ScriptedAgent)(
        task, random.Random(seed), noise, thoughts=thoughts, thought_rng=random.Random(f"thoughts/{seed}"))
    last = None
    while not env.done:
        action = encode(agent.act(last))
        res = env.step(action)
        last = res.record
        ids += action + res.observation
        mask += [True] * len(action) + [False] * len(res.observation)
    return ids, mask, env
