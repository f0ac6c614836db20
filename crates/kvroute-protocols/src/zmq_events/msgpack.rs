//! A borrowed cursor over msgpack bytes for the typed walk of [`super`]: one value's head at a
//! time ([`Item`]), a value skipped whole, depth counted as `rmpv` counts it, and every length
//! checked against the bytes left before anything is read or allocated.

use std::fmt::{self, Display};

use rmp::Marker;

/// Whether a value's bytes are msgpack nil (rmpv reads the reserved marker 0xc1 as nil too).
pub(super) fn is_nil(raw: &[u8]) -> bool {
    matches!(
        raw.first().map(|&b| Marker::from_u8(b)),
        Some(Marker::Null | Marker::Reserved)
    )
}

/// Bytes that are not whole msgpack, or nest deeper than [`MAX_DEPTH`]; the message is made by
/// [`not_msgpack`].
pub(super) struct Malformed;

/// One msgpack value's head, as [`Cursor::item`] reads it.
#[derive(Clone, Copy)]
pub(super) enum Item<'a> {
    /// Nil, or the reserved marker 0xc1 (which rmpv reads as nil).
    Nil,
    Bool,
    Int(Int),
    F32(f32),
    F64(f64),
    /// A string's bytes (UTF-8 or not).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    /// An array's length; its elements follow.
    Array(usize),
    /// A map's length in entries; its keys and values follow, alternating.
    Map(usize),
}

impl<'a> Item<'a> {
    /// What the value is, for error messages.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Item::Nil => "nil",
            Item::Bool => "a boolean",
            Item::Int(_) => "an integer",
            Item::F32(_) | Item::F64(_) => "a float",
            Item::Str(_) => "a string",
            Item::Bin(_) => "bytes",
            Item::Array(_) => "an array",
            Item::Map(_) => "a map",
            Item::Ext => "an extension value",
        }
    }

    /// The string, if this is a UTF-8 string.
    pub(super) fn as_str(&self) -> Option<&'a str> {
        match self {
            Item::Str(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }
}

/// A msgpack integer, as rmpv classifies it: non-negative whatever its encoding, or negative.
#[derive(Clone, Copy)]
pub(super) enum Int {
    Pos(u64),
    Neg(i64),
}

impl Int {
    pub(super) fn signed(i: i64) -> Self {
        u64::try_from(i).map_or(Int::Neg(i), Int::Pos)
    }

    pub(super) fn as_u64(self) -> Option<u64> {
        match self {
            Int::Pos(u) => Some(u),
            Int::Neg(_) => None,
        }
    }

    pub(super) fn as_i64(self) -> Option<i64> {
        match self {
            Int::Pos(u) => i64::try_from(u).ok(),
            Int::Neg(i) => Some(i),
        }
    }

    pub(super) fn as_f64(self) -> f64 {
        match self {
            Int::Pos(u) => u as f64,
            Int::Neg(i) => i as f64,
        }
    }
}

impl Display for Int {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Int::Pos(u) => u.fmt(f),
            Int::Neg(i) => i.fmt(f),
        }
    }
}

/// Reads msgpack values off a byte slice without copying: strings and bytes are borrowed, a
/// container's elements are read one by one after its header. Lengths are checked against the
/// bytes left, never trusted for an allocation.
///
/// Depth is counted as rmpv counts it, so that exactly the payloads rmpv decoded within
/// [`MAX_DEPTH`] are accepted: reading a value costs a level, a container's elements one more
/// level, bytes one more, a string's or extension's contents two more.
#[derive(Clone, Copy)]
pub(super) struct Cursor<'a> {
    pub(super) rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Cursor { rest: bytes }
    }

    pub(super) fn byte(&mut self) -> Result<u8, Malformed> {
        let (&b, rest) = self.rest.split_first().ok_or(Malformed)?;
        self.rest = rest;
        Ok(b)
    }

    pub(super) fn be<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let (bytes, rest) = self.rest.split_first_chunk::<N>().ok_or(Malformed)?;
        self.rest = rest;
        Ok(*bytes)
    }

    pub(super) fn len8(&mut self) -> Result<usize, Malformed> {
        self.byte().map(usize::from)
    }

    pub(super) fn len16(&mut self) -> Result<usize, Malformed> {
        self.be().map(|b| usize::from(u16::from_be_bytes(b)))
    }

    pub(super) fn len32(&mut self) -> Result<usize, Malformed> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| Malformed)
    }

    pub(super) fn bytes(&mut self, len: usize) -> Result<&'a [u8], Malformed> {
        let (bytes, rest) = self.rest.split_at_checked(len).ok_or(Malformed)?;
        self.rest = rest;
        Ok(bytes)
    }

    /// An extension value: its type byte, then `len` bytes of data.
    pub(super) fn ext(&mut self, len: usize) -> Result<Item<'a>, Malformed> {
        self.byte()?;
        self.bytes(len)?;
        Ok(Item::Ext)
    }

    /// Reads one value's head, whatever the depth: a scalar whole, a string's or bytes'
    /// contents, a container's length (its elements are next).
    pub(super) fn item(&mut self) -> Result<Item<'a>, Malformed> {
        let pos = |u: u64| Item::Int(Int::Pos(u));
        let int = |i: i64| Item::Int(Int::signed(i));
        Ok(match Marker::from_u8(self.byte()?) {
            Marker::Null | Marker::Reserved => Item::Nil,
            Marker::True | Marker::False => Item::Bool,
            Marker::FixPos(u) => pos(u.into()),
            Marker::FixNeg(i) => int(i.into()),
            Marker::U8 => pos(self.byte()?.into()),
            Marker::U16 => pos(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => pos(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => pos(u64::from_be_bytes(self.be()?)),
            Marker::I8 => int(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => int(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => int(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Item::F32(f32::from_be_bytes(self.be()?)),
            Marker::F64 => Item::F64(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(len) => Item::Str(self.bytes(len.into())?),
            Marker::Str8 => Item::Str(self.len8().and_then(|len| self.bytes(len))?),
            Marker::Str16 => Item::Str(self.len16().and_then(|len| self.bytes(len))?),
            Marker::Str32 => Item::Str(self.len32().and_then(|len| self.bytes(len))?),
            Marker::Bin8 => Item::Bin(self.len8().and_then(|len| self.bytes(len))?),
            Marker::Bin16 => Item::Bin(self.len16().and_then(|len| self.bytes(len))?),
            Marker::Bin32 => Item::Bin(self.len32().and_then(|len| self.bytes(len))?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => self.len8().and_then(|len| self.ext(len))?,
            Marker::Ext16 => self.len16().and_then(|len| self.ext(len))?,
            Marker::Ext32 => self.len32().and_then(|len| self.ext(len))?,
            Marker::FixArray(len) => Item::Array(len.into()),
            Marker::Array16 => Item::Array(self.len16()?),
            Marker::Array32 => Item::Array(self.len32()?),
            Marker::FixMap(len) => Item::Map(len.into()),
            Marker::Map16 => Item::Map(self.len16()?),
            Marker::Map32 => Item::Map(self.len32()?),
        })
    }

    /// The next value if it is an unsigned integer (as most tokens and hashes are): the fast path
    /// of [`Cursor::item`], which reads anything else. Depth is the caller's to check.
    #[inline]
    pub(super) fn uint(&mut self) -> Option<u64> {
        let (&marker, rest) = self.rest.split_first()?;
        let (u, rest) = match marker {
            0x00..=0x7f => (u64::from(marker), rest),
            0xcc => rest.split_first().map(|(&b, rest)| (u64::from(b), rest))?,
            0xcd => rest
                .split_first_chunk()
                .map(|(b, rest)| (u64::from(u16::from_be_bytes(*b)), rest))?,
            0xce => rest
                .split_first_chunk()
                .map(|(b, rest)| (u64::from(u32::from_be_bytes(*b)), rest))?,
            0xcf => rest
                .split_first_chunk()
                .map(|(b, rest)| (u64::from_be_bytes(*b), rest))?,
            _ => return None,
        };
        self.rest = rest;
        Some(u)
    }

    /// Reads one value's head at `depth`, checking the depth it needs; also returns the depth of
    /// its elements, if it is a container.
    pub(super) fn enter(&mut self, depth: usize) -> Result<(Item<'a>, usize), Malformed> {
        let depth = depth.checked_sub(1).ok_or(Malformed)?;
        let item = self.item()?;
        let needs = match item {
            Item::Str(_) | Item::Ext => 2,
            Item::Bin(_) | Item::Array(_) | Item::Map(_) => 1,
            _ => 0,
        };
        Ok((item, depth.checked_sub(needs).ok_or(Malformed)?))
    }

    /// Skips the elements of a value whose head `enter` read (nothing, if it is not a container).
    pub(super) fn finish(&mut self, head: Item<'a>, depth: usize) -> Result<(), Malformed> {
        match head {
            Item::Array(len) => self.skip_n(len, depth),
            // Overflow is fine: the bytes run out long before.
            Item::Map(len) => self.skip_n(len.saturating_mul(2), depth),
            _ => Ok(()),
        }
    }

    /// Skips one whole value, checking that its bytes are all there and that it nests no deeper
    /// than `depth`. Every value takes at least a byte, so a container claiming more elements
    /// than there are bytes left fails at the end of the bytes.
    pub(super) fn skip(&mut self, depth: usize) -> Result<(), Malformed> {
        let (head, inner) = self.enter(depth)?;
        self.finish(head, inner)
    }

    pub(super) fn skip_n(&mut self, n: usize, depth: usize) -> Result<(), Malformed> {
        for _ in 0..n {
            self.skip(depth)?;
        }
        Ok(())
    }

    /// Reads one whole value and returns its head (a container's elements skipped).
    pub(super) fn whole(&mut self, depth: usize) -> Result<Item<'a>, Malformed> {
        let (head, inner) = self.enter(depth)?;
        self.finish(head, inner)?;
        Ok(head)
    }

    /// The bytes of one whole value.
    pub(super) fn value(&mut self, depth: usize) -> Result<&'a [u8], Malformed> {
        let start = self.rest;
        self.skip(depth)?;
        let len = start.len().checked_sub(self.rest.len()).ok_or(Malformed)?;
        start.get(..len).ok_or(Malformed)
    }
}
