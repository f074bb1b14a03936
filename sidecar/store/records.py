"""What the node-wide store (``sidecar.store.node``) keeps in its zones, as
bytes: the limiters' states, ban records, the notes bans react to, and the
text of counting keys; and the digests that name them.

A zone holds fixed-size records, each named by a 16-byte digest and worth
a few dozen bytes of value (``sidecar.shm``), shared by every worker of a
node. So nothing here is a Python object between two requests: a state is
read from its bytes when the policy asks for it and written back as bytes
when the request is decided. Each known algorithm has a fixed layout
(``struct``), chosen by the state's type; a limiter only the rules' plug-ins
know is kept as its dataclass's fields through ``marshal``.

A state's record is its bytes followed by the key's text, when the text
fits in what is left of the record: the admin API lists keys by reading it.
The text is the 8-byte code of the key's prefix (its rule id and dimension
names, kept once in the prefixes zone) and the ``repr`` of the key's values
(``key_text``, which ``parse_key`` reads back), so that a key of one or two
short values fits. A key too long for its record has the ``ELSEWHERE``
flag, and its text is kept in the labels zone under the same digest.
"""

from __future__ import annotations

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

import ast
import dataclasses
import hashlib
import marshal
import math
import struct
from collections.abc import Hashable
from typing import Any

from sidecar.config import Rate
from sidecar.keys import CountingKey
from sidecar.limiters.base import Limiter
from sidecar.limiters.concurrent import ConcurrencyLimiter, LeaseState
from sidecar.limiters.leaky import LeakyBucket, LeakyState
from sidecar.limiters.token import TokenBucket, TokenState
from sidecar.limiters.window import WindowCounter, WindowState
from sidecar.policy import BAN_STEP, COUNTED_PENALTY, Note
from sidecar.state import BanRecord

DIGEST_BYTES = 16
SECRET_BYTES = 16
_blake2b = hashlib.blake2b

# -- the digests that name records ---------------------------------------------

_MASK64 = 0xFFFFFFFFFFFFFFFF  # a C integer's wrap, for the same code run as Python
# SipHash's initial words ("somepseudorandomlygeneratedbytes").
_SIP0, _SIP1, _SIP2, _SIP3 = 0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573
_pack_words = struct.Struct("<QQ").pack
# What a compiled digest or state is copied from (a slice of it, a new
# bytes object made in C) before its words are written in: room for the
# longest, a state's kind and four words, with a key's text after them.
_SPACE_SIZE = 512  # compiled: a C constant, as is _ELSEWHERE_BIT (records.pxd)
_SPACE = bytes(_SPACE_SIZE)


@cython.cclass
class _SipState:
    """SipHash's four words (``siphash128``)."""

    __slots__ = ("v0", "v1", "v2", "v3")
    v0: int
    v1: int
    v2: int
    v3: int

    def rounds(self, count: int) -> None:
        """``count`` SipRounds."""
        v0, v1, v2, v3 = self.v0, self.v1, self.v2, self.v3
        for turn in range(count):  # noqa: B007 - counted, not read
            v0 = (v0 + v1) & _MASK64
            v1 = ((v1 << 13) | (v1 >> 51)) & _MASK64
            v1 ^= v0
            v0 = ((v0 << 32) | (v0 >> 32)) & _MASK64
            v2 = (v2 + v3) & _MASK64
            v3 = ((v3 << 16) | (v3 >> 48)) & _MASK64
            v3 ^= v2
            v0 = (v0 + v3) & _MASK64
            v3 = ((v3 << 21) | (v3 >> 43)) & _MASK64
            v3 ^= v0
            v2 = (v2 + v1) & _MASK64
            v1 = ((v1 << 17) | (v1 >> 47)) & _MASK64
            v1 ^= v2
            v2 = ((v2 << 32) | (v2 >> 32)) & _MASK64
        self.v0, self.v1, self.v2, self.v3 = v0, v1, v2, v3


def siphash128(k0: int, k1: int, data: bytes) -> bytes:
    """SipHash-2-4 with its 128-bit output (Aumasson and Bernstein) of
    ``data`` under the key whose two little-endian halves are ``k0`` and
    ``k1``: a keyed hash, so that nobody without the key can choose names
    that meet in one stripe or bucket. Compiled, the words are C integers."""
    state = _SipState.__new__(_SipState)  # its words set here, in C, without a call of the class
    state.v0 = k0 ^ _SIP0
    state.v1 = k1 ^ _SIP1 ^ 0xEE  # 0xEE: the 128-bit output
    state.v2 = k0 ^ _SIP2
    state.v3 = k1 ^ _SIP3
    raw = data  # compiled: its bytes, read in C
    length = len(data)
    start = 0
    while True:
        take = min(8, length - start)
        word = 0
        for shift in range(take):
            byte = raw[start + shift]
            word |= byte << (8 * shift)
        if take < 8:
            last = length & 0xFF
            word |= last << 56  # the last word: what is left, and the length
        state.v3 ^= word
        state.rounds(2)
        state.v0 ^= word
        if take < 8:
            break
        start += 8
    state.v2 ^= 0xEE
    state.rounds(4)
    first = state.v0 ^ state.v1 ^ state.v2 ^ state.v3
    state.v1 ^= 0xDD
    state.rounds(4)
    second = state.v0 ^ state.v1 ^ state.v2 ^ state.v3
    if not cython.compiled:
        return _pack_words(first, second)
    # Compiled: the two words written little-endian into a new bytes object
    # that nothing else holds yet (struct's pack converts each to a Python
    # integer and back: most of the digest's cost).
    space = _SPACE  # compiled: a pointer, whose slice is a new bytes object made in C
    digest = space[:16]
    _put_word(digest, 0, first)
    _put_word(digest, 8, second)
    return digest


def _put_word(written: bytes, at: int, word: int) -> None:
    """Compiled only: ``word``, a C integer, little-endian into the bytes
    ``written[at:at + 8]`` of a bytes object nothing else holds yet."""
    bits = word & _MASK64
    for shift in range(8):
        written[at + shift] = (bits >> (8 * shift)) & 0xFF  # type: ignore[index]


@cython.cclass
class Namer:
    """The 16-byte digests that name a node's records: SipHash-2-4 (128
    bits) of a name's text keyed by the node's secret (the states zone's,
    ``sidecar.shm``'s ``Zone.secret``), the same in every worker (Python's
    own ``hash`` is seeded per process). Nobody outside the node can tell
    which stripe a key of their choosing falls in, so nobody can crowd one
    stripe to evict a key they aim at: the table's LRU is as hard to game
    as one of its whole size."""

    __slots__ = ("k0", "k1")

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a node's secret is {SECRET_BYTES} bytes, not {len(secret)}")
        self.k0 = int.from_bytes(secret[:8], "little")
        self.k1 = int.from_bytes(secret[8:], "little")

    def digest(self, text: bytes) -> bytes:
        """The digest of a name's text."""
        return siphash128(self.k0, self.k1, text)

    def key_name(self, key: Hashable) -> tuple[bytes, bytes, bytes]:
        """A counting key's text (``key_text``), the digest of it that names
        its record and its prefix's text (``prefix_of``), worked out in one
        call: what the node store works out once for each key it meets."""
        # Typed by the annotation, not cast: cast is a call in the compiled core.
        counting: CountingKey = key  # type: ignore[assignment]
        code, prefix_text = prefix_of(counting)
        text = code + values_text(counting)  # key_text, its prefix looked up once
        return text, siphash128(self.k0, self.k1, text), prefix_text

    def ban_name(self, address: str) -> bytes:
        """The digest of an address's (or a network's) ban record."""
        return siphash128(self.k0, self.k1, address.encode())

    def note_name(self, name: Note) -> bytes:
        """The digest of a note's record."""
        return siphash128(self.k0, self.k1, repr(name).encode())


# -- counting keys -------------------------------------------------------------

PREFIX_CODE_BYTES = 8
# Each key prefix's code and text, as worked out once (a ruleset has a few
# prefixes; forgotten all at once past this many).
_PREFIXES: dict[Hashable, tuple[bytes, bytes]] = {}
PREFIXES_KEPT = 4096


def prefix_of(key: Hashable) -> tuple[bytes, bytes]:
    """The code and the text of a counting key's prefix: its rule id and
    dimension names, ``repr`` of them and 8 bytes of its BLAKE2b."""
    counting: CountingKey = key  # type: ignore[assignment]  # not cast: a call in the compiled core
    prefix = counting[0]
    prefixes = _PREFIXES  # compiled: a dict's get, in C
    known = prefixes.get(prefix)
    if known is None:
        if len(prefixes) >= PREFIXES_KEPT:
            prefixes.clear()
        text = repr(prefix).encode()
        known = prefixes[prefix] = (_blake2b(text, digest_size=PREFIX_CODE_BYTES).digest(), text)
    return known


def key_text(key: Hashable) -> bytes:
    """A counting key as text: its prefix's code, then the ``repr`` of its
    values (text values are quoted and escaped: unambiguous, always UTF-8)."""
    counting: CountingKey = key  # type: ignore[assignment]  # not cast: a call in the compiled core
    return prefix_of(counting)[0] + values_text(counting)


def values_text(key: tuple[Any, ...]) -> bytes:
    """``repr`` of a counting key's values (all but its prefix), encoded:
    written out for the common key, whose values are texts of printable
    ASCII without a quote or a backslash (which ``repr`` quotes as they
    are), or tuples of them; ``repr`` itself for any other. Under rotation
    every key a check reads is named anew, and ``repr`` costs three times
    this."""
    count = len(key)
    if count == 2 or count == 3:  # one value or two, plain: nearly every key, without a list
        value = key[1]
        if _plain(value):
            first: str = value  # compiled: a text, concatenated and encoded in C
            if count == 2:
                return ("('" + first + "',)").encode()
            value = key[2]
            if _plain(value):
                second: str = value
                return ("('" + first + "', '" + second + "')").encode()
    pieces: list[str] = []
    if _repr_into(key, 1, pieces):
        return "".join(pieces).encode()
    return repr(key[1:]).encode()


def _plain(value: object) -> bool:
    """Whether ``repr`` quotes ``value`` as it is: a text of printable ASCII
    without a quote or a backslash."""
    if type(value) is not str:
        return False
    text: str = value
    for char in text:
        if char < " " or char > "~" or char == "'" or char == "\\":
            return False
    return True


def _repr_into(values: tuple[Any, ...], first: int, pieces: list[str]) -> bool:
    """``repr(values[first:])`` added to ``pieces``, when it is written out
    as ``values_text`` says; False for any other."""
    pieces.append("(")
    for index in range(first, len(values)):
        if index > first:
            pieces.append(", ")
        value = values[index]
        if type(value) is tuple:
            if not _repr_into(value, 0, pieces):
                return False
            continue
        if not _plain(value):
            return False
        pieces.append("'")
        pieces.append(value)
        pieces.append("'")
    pieces.append(",)" if len(values) - first == 1 else ")")
    return True

def parse_prefix(text: bytes) -> Any:
    """The key prefix ``prefix_of`` wrote, or None for anything else."""
    value = _literal(text)
    return value if _is_prefix(value) else None


def parse_key(text: bytes, prefixes: dict[bytes, Any]) -> CountingKey | None:
    """The counting key ``key_text`` wrote, its prefix found by its code in
    ``prefixes``; None for anything else."""
    prefix = prefixes.get(text[:PREFIX_CODE_BYTES])
    values = _literal(text[PREFIX_CODE_BYTES:])
    if prefix is None or not isinstance(values, tuple):
        return None
    for part in values:
        if isinstance(part, tuple):
            if len(part) != 2 or not all(isinstance(item, str) for item in part):
                return None
        elif not isinstance(part, str):
            return None
    return (prefix, *values)


def _literal(text: bytes) -> Any:
    try:
        return ast.literal_eval(text.decode())
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError, TypeError):
        return None


def _is_prefix(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) \
        and isinstance(value[1], tuple) and all(isinstance(name, str) for name in value[1])


# -- limiter states --------------------------------------------------------------

# The first byte of a state's record: its layout, ELSEWHERE when the key's
# text is in the labels zone, and SPENT when its state matters at no time.
WINDOW, TOKEN, LEAKY, LEASES, OTHER = 1, 2, 3, 4, 5
ELSEWHERE = 0x80
_ELSEWHERE_BIT = ELSEWHERE
SPENT = 0x40  # its state matters at no time (a lease state without a lease): kept, not in force
KIND_MASK = 0x3F

_WINDOW = struct.Struct("<Bqqqd")  # window, previous, current, penalty_until
_TOKEN = struct.Struct("<Bddd")  # tokens, last (NaN: None), penalty_until
_LEAKY = struct.Struct("<Bqqd")  # excess, last (NO_LAST: None), penalty_until
_LEASES = struct.Struct("<BH")  # the number of leases that follow
_LEASE = struct.Struct("<B9sd")  # the lease id's form, its 9 bytes, when it ends
_OTHER = struct.Struct("<BH")  # the length of the marshalled fields that follow
NO_LAST = -(1 << 63)
LEASE_BYTES = _LEASE.size

# A state whose record names no limiter of the caller's: a stand-in of its
# algorithm, so that the policy sees a state of another algorithm (which
# starts anew) and a lease state can still give its slots back.
_STAND_INS: dict[int, Limiter] = {
    WINDOW: WindowCounter(1, 1.0, 1.0),
    TOKEN: TokenBucket(1, 1.0, 1, None),
    LEAKY: LeakyBucket(Rate(1, 1), 0, None, None),
    LEASES: ConcurrencyLimiter(1, 1.0),
}
_KINDS: dict[type, int] = {WindowCounter: WINDOW, TokenBucket: TOKEN, LeakyBucket: LEAKY,
                           ConcurrencyLimiter: LEASES}


def kind_of(limiter: Limiter | None) -> int:
    """The record layout of a limiter's states (None: no limiter known)."""
    if limiter is None:
        return 0
    return _KINDS.get(type(limiter), OTHER)


# The three layouts above as their kind's byte and 64-bit words (a double's
# are its bits): what encode_state writes, the same bytes.
_WORDS = {count: struct.Struct("<B" + "q" * count) for count in (3, 4)}
_DOUBLE, _SIGNED_WORD = struct.Struct("<d"), struct.Struct("<q")
# A double and its bits in one place (compiled: a C union).
DoubleBits = cython.union(real=cython.double, bits=cython.longlong)


def _double_word(value: float) -> int:
    """A double's IEEE 754 bits as a signed 64-bit word: struct's "<d"
    bytes read as "<q"."""
    if not cython.compiled:
        return int(_SIGNED_WORD.unpack(_DOUBLE.pack(value))[0])
    both = cython.declare(DoubleBits)
    both.real = value
    bits: int = both.bits
    return bits


def _state_bytes(kind: int, count: int, first: int, second: int, third: int, fourth: int,
                 text: bytes | None, room: int, flags: int) -> bytes:
    """A state's bytes: its kind and ``count`` (3 or 4) signed 64-bit
    words, little-endian, in a record as ``encode_state`` says. Compiled,
    written in C into a new bytes object (struct's pack makes a Python
    object of every field and reads it back: most of a state's cost to
    write), the text copied after the words."""
    size = 1 + 8 * count
    if not cython.compiled or (text is not None and size + len(text) > _SPACE_SIZE):
        return _in_record(_WORDS[count].pack(kind, *(first, second, third, fourth)[:count]), text, room, flags)
    flags = _placed(size, text, room, flags)
    tail = _following(text, room, flags)
    space = _SPACE  # compiled: a pointer, whose slice is a new bytes object made in C
    value = space[:size + tail]
    written = value  # compiled: its bytes, written in C
    written[0] = kind | flags  # type: ignore[index]
    _put_word(value, 1, first)
    _put_word(value, 9, second)
    _put_word(value, 17, third)
    if count == 4:
        _put_word(value, 25, fourth)
    if tail:
        copied = text  # compiled: its bytes, read in C
        for at in range(tail):
            written[size + at] = copied[at]  # type: ignore[index]
    return value


def _placed(size: int, text: bytes | None, room: int, flags: int) -> int:
    """The first byte's flags of a state of ``size`` bytes in a record of
    ``room`` bytes: ``flags``, and ELSEWHERE unless the key's ``text``
    follows the state; none outside a record (``room`` < 0)."""
    if room < 0:
        return 0
    if text is not None and size + len(text) <= room:
        return flags
    return flags | _ELSEWHERE_BIT


def _following(text: bytes | None, room: int, flags: int) -> int:
    """The bytes of the key's ``text`` that follow a state in its record
    (``flags`` as ``_placed`` gave them): all of it, unless it is
    elsewhere or the state is not in a record."""
    return len(text) if text is not None and room >= 0 and not flags & _ELSEWHERE_BIT else 0


def _in_record(value: bytes, text: bytes | None, room: int, flags: int) -> bytes:
    """A state's bytes ``value`` in a record, as ``encode_state`` says."""
    flags = _placed(len(value), text, room, flags)
    if text is not None and _following(text, room, flags):
        value += text
    if flags:
        value = bytes((value[0] | flags,)) + value[1:]
    return value


def encode_state(state: Any, lease_slots: int, text: bytes | None = None, room: int = -1, flags: int = 0) -> bytes:
    """A state's bytes, the key's text aside. A lease state keeps at most
    ``lease_slots`` leases (the latest to end): the store caps concurrency
    limits at that many before it decides.

    In a zone's record of ``room`` bytes (``room`` >= 0): the key's ``text``
    after the state's bytes when both fit, else (or when ``text`` is None:
    the text is kept elsewhere) the flag ELSEWHERE; and ``flags`` in the
    first byte with the state's kind. One bytes object, however made."""
    kind = type(state)
    if kind is WindowState:
        window = state  # each read as its type: its fields in C
        return _state_bytes(WINDOW, 4, window.window, window.previous, window.current,
                            _double_word(window.penalty_until), text, room, flags)
    if kind is TokenState:
        token = state
        last = token.last
        return _state_bytes(TOKEN, 3, _double_word(token.tokens), _double_word(math.nan if last is None else last),
                            _double_word(token.penalty_until), 0, text, room, flags)
    if kind is LeakyState:
        leaky = state
        last = leaky.last
        return _state_bytes(LEAKY, 3, leaky.excess, NO_LAST if last is None else last,
                            _double_word(leaky.penalty_until), 0, text, room, flags)
    if kind is LeaseState:
        return _in_record(_encode_leases(state.held, lease_slots), text, room, flags)
    return _in_record(_encode_other(state), text, room, flags)


def _encode_leases(held: dict[str, float], lease_slots: int) -> bytes:
    if len(held) > lease_slots:
        held = dict(sorted(held.items(), key=lambda lease: lease[1])[-lease_slots:])
    return _LEASES.pack(LEASES, len(held)) + b"".join(_LEASE.pack(*_lease_id(lease), ends)
                                                       for lease, ends in held.items())


def _encode_other(state: Any) -> bytes:
    """A plug-in's state: its dataclass's fields but the limiter, marshalled."""
    fields = marshal.dumps((_code(state.limiter),
                            tuple(getattr(state, field.name) for field in dataclasses.fields(state)
                                  if field.name != "limiter")))
    return _OTHER.pack(OTHER, len(fields)) + fields


def state_length(value: bytes) -> int:
    """Where a state's bytes end in its record (the key's text follows)."""
    kind = value[0] & KIND_MASK
    if kind == WINDOW:
        return _WINDOW.size
    if kind in (TOKEN, LEAKY):
        return _TOKEN.size
    if kind == LEASES:
        return _LEASES.size + int(_LEASES.unpack_from(value)[1]) * LEASE_BYTES
    return _OTHER.size + int(_OTHER.unpack_from(value)[1])


def decode_state(value: bytes, limiter: Limiter | None) -> Any:
    """The state a record holds, belonging to ``limiter`` when it is of the
    record's algorithm (else to a stand-in of the record's: the policy then
    starts the key anew); None for a plug-in's state no limiter of the
    caller's can read."""
    kind = value[0] & KIND_MASK
    own = type(limiter)
    if kind == WINDOW:
        _, window, previous, current, penalty_until = _WINDOW.unpack_from(value)
        return WindowState(window, previous, current, penalty_until,
                           limiter if own is WindowCounter else _STAND_INS[WINDOW])
    if kind == TOKEN:
        _, tokens, last, penalty_until = _TOKEN.unpack_from(value)
        return TokenState(tokens, None if math.isnan(last) else last, penalty_until,
                          limiter if own is TokenBucket else _STAND_INS[TOKEN])
    if kind == LEAKY:
        _, excess, last, penalty_until = _LEAKY.unpack_from(value)
        return LeakyState(excess, None if last == NO_LAST else last, penalty_until,
                          limiter if own is LeakyBucket else _STAND_INS[LEAKY])
    if kind == LEASES:
        return LeaseState(_decode_leases(value), limiter if own is ConcurrencyLimiter else _STAND_INS[LEASES])
    return _decode_other(value, None if kind_of(limiter) in _STAND_INS else limiter)


def _decode_leases(value: bytes) -> dict[str, float]:
    held = {}
    for n in range(_LEASES.unpack_from(value)[1]):
        form, packed, ends = _LEASE.unpack_from(value, _LEASES.size + n * LEASE_BYTES)
        held[_lease_text(form, packed)] = ends
    return held


def _decode_other(value: bytes, limiter: Limiter | None) -> Any:
    if limiter is None:
        return None
    length = _OTHER.unpack_from(value)[1]
    try:
        code, fields = marshal.loads(value[_OTHER.size:_OTHER.size + length])
    except (ValueError, EOFError, TypeError):
        return None
    if code != _code(limiter):
        return None
    state = limiter.new_state()
    names = [field.name for field in dataclasses.fields(state) if field.name != "limiter"]
    if len(names) != len(fields):
        return None
    for name, field in zip(names, fields):
        setattr(state, name, field)
    return state


def _code(limiter: Limiter) -> str:
    """A plug-in's kind code (its Redis scripts' first argument)."""
    return limiter.redis_args(1.0)[0]


# A lease id's form in its record: up to 9 bytes of UTF-8 as they are (the
# length), the 18 hex digits the engine makes packed in 9, or a hash of a
# longer id (no response report names such a lease; it ends with its lease).
_HEX = 0x80
_HASHED = 0xFF
_HEX_DIGITS = frozenset("0123456789abcdef")


def _lease_id(lease: str) -> tuple[int, bytes]:
    raw = lease.encode()
    if len(raw) <= 9:
        return len(raw), raw
    if len(lease) == 18 and _HEX_DIGITS.issuperset(lease):
        return _HEX, bytes.fromhex(lease)
    return _HASHED, _blake2b(raw, digest_size=9).digest()


def _lease_text(form: int, packed: bytes) -> str:
    if form == _HEX:
        return packed.hex()
    if form == _HASHED:
        return "#" + packed.hex()
    return packed[:form].decode(errors="replace")


def lease_value_bytes(slots: int) -> int:
    """The bytes of a lease state of ``slots`` leases."""
    return _LEASES.size + slots * LEASE_BYTES


# -- bans --------------------------------------------------------------------------

_BAN = struct.Struct("<dddBi")  # started_wall, expires, duration, shadow, step
BAN_TEXTS = 4  # address, rule id, node, reason: a length byte and UTF-8 each


def encode_ban(record: BanRecord, room: int) -> bytes:
    """A ban record in at most ``room`` bytes. Texts are shortened to fit
    (at a character boundary), the reason first, then the node's name: in
    a record of the bans zone, any client key or network (43 characters at
    most) and any rule id (64) fit whole; the record is found by its
    address's digest whatever its text says."""
    head = _BAN.pack(record.started_wall, record.expires, record.duration, record.shadow, record.step)
    texts = [_shortened(text.encode(), 255) for text in
             (record.address, record.rule_id, record.node, record.reason)]
    left = room - len(head) - BAN_TEXTS
    for index in (3, 2, 1, 0):
        over = sum(map(len, texts)) - left
        if over <= 0:
            break
        texts[index] = _shortened(texts[index], len(texts[index]) - over)
    return head + b"".join(bytes((len(text),)) + text for text in texts)


def _shortened(text: bytes, room: int) -> bytes:
    if len(text) <= room:
        return text
    return text[:max(room, 0)].decode(errors="ignore").encode()


def decode_ban(value: bytes) -> BanRecord:
    started_wall, expires, duration, shadow, step = _BAN.unpack_from(value)
    texts = []
    at = _BAN.size
    for _ in range(BAN_TEXTS):
        length = value[at]
        texts.append(value[at + 1:at + 1 + length].decode(errors="replace"))
        at += 1 + length
    address, rule_id, node, reason = texts
    return BanRecord(address, rule_id, node, started_wall, expires, duration, bool(shadow), step, reason)


# -- notes ---------------------------------------------------------------------------

_NOTE_HEAD = struct.Struct("<B8s")  # the value's form, the address's hash
_STEP = struct.Struct("<qd")  # an escalating ban's step and length
NOTE_STEP, NOTE_TRUE, NOTE_OTHER = 1, 2, 3


def address_hash(address: str) -> bytes:
    """Eight bytes of the address a note is about: ``forget_history`` finds
    an address's notes by it."""
    return _blake2b(address.encode(), digest_size=8).digest()


def encode_note(name: Note, value: Any) -> bytes:
    kind, address = name[0], name[1]
    if kind == BAN_STEP and isinstance(value, tuple) and len(value) == 2:
        return _NOTE_HEAD.pack(NOTE_STEP, address_hash(address)) + _STEP.pack(*value)
    if kind == COUNTED_PENALTY and value is True:
        return _NOTE_HEAD.pack(NOTE_TRUE, address_hash(address))
    return _NOTE_HEAD.pack(NOTE_OTHER, address_hash(address)) + marshal.dumps(value)


def decode_note(value: bytes) -> Any:
    form = value[0]
    if form == NOTE_STEP:
        step, duration = _STEP.unpack_from(value, _NOTE_HEAD.size)
        return step, duration
    if form == NOTE_TRUE:
        return True
    return marshal.loads(value[_NOTE_HEAD.size:])


def note_of_address(value: bytes, hashed: bytes) -> bool:
    return value[1:_NOTE_HEAD.size] == hashed


def note_bytes() -> int:
    """The longest note the policy keeps."""
    return _NOTE_HEAD.size + _STEP.size
