//! Serde plumbing that lets one set of types speak both JSON and bincode.
//!
//! The reference omits `None` fields from JSON (`skip_serializing_if = "Option::is_none"`), but a
//! non-self-describing format such as bincode cannot skip a field: the reader expects every field,
//! in order. So the wire types in this crate write their `Serialize` impls through [`WireStruct`],
//! which skips empty fields only when the serializer is human readable (JSON) and writes every
//! field otherwise (bincode). `Deserialize` stays derived: with `#[serde(default)]` a missing JSON
//! field becomes its default, and bincode always finds every field present.
//!
//! The same split handles opaque engine payloads (`serde_json::Value`): bincode cannot decode a
//! self-describing value, so on compact formats the value travels as its JSON text.

use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Deserializer, Serialize};

/// A struct being serialized, remembering whether empty fields may be skipped.
pub(crate) struct WireStruct<S: Serializer> {
    inner: S::SerializeStruct,
    human_readable: bool,
}

impl<S: Serializer> WireStruct<S> {
    /// Starts a struct named `name` with `len` fields (compact formats ignore the count).
    pub(crate) fn new(serializer: S, name: &'static str, len: usize) -> Result<Self, S::Error> {
        let human_readable = serializer.is_human_readable();
        Ok(Self {
            inner: serializer.serialize_struct(name, len)?,
            human_readable,
        })
    }

    /// A field that is always written.
    pub(crate) fn field<T: ?Sized + Serialize>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), S::Error> {
        self.inner.serialize_field(key, value)
    }

    /// An optional field: omitted from JSON when `None`, always written to bincode.
    pub(crate) fn opt<T: Serialize>(
        &mut self,
        key: &'static str,
        value: &Option<T>,
    ) -> Result<(), S::Error> {
        self.skip_if(key, value, value.is_none())
    }

    /// A field omitted from JSON when `empty` holds, always written to bincode.
    pub(crate) fn skip_if<T: ?Sized + Serialize>(
        &mut self,
        key: &'static str,
        value: &T,
        empty: bool,
    ) -> Result<(), S::Error> {
        if empty && self.human_readable {
            self.inner.skip_field(key)
        } else {
            self.inner.serialize_field(key, value)
        }
    }

    /// Finishes the struct.
    pub(crate) fn end(self) -> Result<S::Ok, S::Error> {
        self.inner.end()
    }
}

/// Serializes an opaque JSON value: as itself in JSON, as its JSON text in compact formats.
pub(crate) struct JsonBlob<'a>(pub(crate) &'a serde_json::Value);

impl Serialize for JsonBlob<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            self.0.serialize(serializer)
        } else {
            serializer.serialize_str(&self.0.to_string())
        }
    }
}

/// Maps an optional JSON value to its serializable form.
pub(crate) fn blob(value: &Option<serde_json::Value>) -> Option<JsonBlob<'_>> {
    value.as_ref().map(JsonBlob)
}

/// `deserialize_with` counterpart of [`JsonBlob`] for a required value.
pub(crate) fn de_json<'de, D: Deserializer<'de>>(d: D) -> Result<serde_json::Value, D::Error> {
    if d.is_human_readable() {
        serde_json::Value::deserialize(d)
    } else {
        let text = String::deserialize(d)?;
        serde_json::from_str(&text).map_err(serde::de::Error::custom)
    }
}

/// `deserialize_with` counterpart of [`JsonBlob`] for an optional value.
pub(crate) fn de_opt_json<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<serde_json::Value>, D::Error> {
    if d.is_human_readable() {
        Option::<serde_json::Value>::deserialize(d)
    } else {
        match Option::<String>::deserialize(d)? {
            Some(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}
