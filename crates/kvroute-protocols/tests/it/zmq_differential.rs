//! The typed msgpack walk (`decode_event_batch`) against the value-tree decoder it replaced
//! (`zmq_reference`), on generated batches in both event encodings, with unknown and repeated
//! fields, wrong types, nils (also as the reserved marker 0xc1), bigrams, byte and negative
//! hashes, `extra_keys`, every msgpack width an integer, string, bytes or container header can be
//! written in, and the same payloads cut short or with a byte changed: results, errors and their
//! messages must be the same. Then hostile payloads directly: truncations, huge declared lengths,
//! nesting at and past the depth limit.

use kvroute_protocols::ProtocolError;
use kvroute_protocols::zmq_events::{EngineEventBatch, EngineKvEvent, MAX_DEPTH};
use kvroute_protocols::{DpRank, decode_event_batch};
use proptest::collection::vec;
use proptest::prelude::*;
use rmpv::Value;

use crate::zmq_reference;

// --- Encoding: any valid msgpack form, not only the shortest ---------------------------------

/// A msgpack writer that picks, from a seed, among the valid encodings of each value: an integer
/// in any width that holds it (signed or unsigned), a string, bytes or container header in any
/// width that holds its length, nil sometimes as the reserved marker 0xc1 (read as nil too).
struct Encoder {
    state: u64,
    out: Vec<u8>,
}

impl Encoder {
    fn encode(value: &Value, seed: u64) -> Vec<u8> {
        let mut enc = Encoder {
            state: seed | 1,
            out: Vec::new(),
        };
        enc.value(value);
        enc.out
    }

    /// xorshift64: enough to vary the choices, reproducible from the seed.
    fn pick(&mut self, n: usize) -> usize {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state % n as u64) as usize
    }

    fn one_of(&mut self, forms: &[&[u8]]) {
        let form = forms[self.pick(forms.len())];
        self.out.extend_from_slice(form);
    }

    /// A length header: the fix form (`marker`, largest length) when given and the length fits,
    /// else 8, 16 or 32 bits.
    fn header(&mut self, len: usize, fix: Option<(u8, usize)>, markers: [Option<u8>; 3]) {
        let mut forms: Vec<Vec<u8>> = Vec::new();
        if let Some((fix, max)) = fix
            && len <= max
        {
            forms.push(vec![fix | len as u8]);
        }
        if let Some(m) = markers[0]
            && let Ok(l) = u8::try_from(len)
        {
            forms.push(vec![m, l]);
        }
        if let Some(m) = markers[1]
            && let Ok(l) = u16::try_from(len)
        {
            let mut f = vec![m];
            f.extend_from_slice(&l.to_be_bytes());
            forms.push(f);
        }
        if let Some(m) = markers[2] {
            let mut f = vec![m];
            f.extend_from_slice(&(len as u32).to_be_bytes());
            forms.push(f);
        }
        let refs: Vec<&[u8]> = forms.iter().map(Vec::as_slice).collect();
        self.one_of(&refs);
    }

    fn int(&mut self, v: &rmpv::Integer) {
        let mut forms: Vec<Vec<u8>> = Vec::new();
        let with = |marker: u8, bytes: &[u8]| {
            let mut f = vec![marker];
            f.extend_from_slice(bytes);
            f
        };
        if let Some(u) = v.as_u64() {
            if u < 128 {
                forms.push(vec![u as u8]);
            }
            if let Ok(b) = u8::try_from(u) {
                forms.push(with(0xcc, &b.to_be_bytes()));
            }
            if let Ok(b) = u16::try_from(u) {
                forms.push(with(0xcd, &b.to_be_bytes()));
            }
            if let Ok(b) = u32::try_from(u) {
                forms.push(with(0xce, &b.to_be_bytes()));
            }
            forms.push(with(0xcf, &u.to_be_bytes()));
        }
        if let Some(i) = v.as_i64() {
            if (-32..0).contains(&i) {
                forms.push(vec![i as i8 as u8]);
            }
            if let Ok(b) = i8::try_from(i) {
                forms.push(with(0xd0, &b.to_be_bytes()));
            }
            if let Ok(b) = i16::try_from(i) {
                forms.push(with(0xd1, &b.to_be_bytes()));
            }
            if let Ok(b) = i32::try_from(i) {
                forms.push(with(0xd2, &b.to_be_bytes()));
            }
            forms.push(with(0xd3, &i.to_be_bytes()));
        }
        let refs: Vec<&[u8]> = forms.iter().map(Vec::as_slice).collect();
        self.one_of(&refs);
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.one_of(&[&[0xc0], &[0xc0], &[0xc1]]),
            Value::Boolean(b) => self.out.push(if *b { 0xc3 } else { 0xc2 }),
            Value::Integer(i) => self.int(i),
            Value::F32(f) => {
                self.out.push(0xca);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::F64(f) => {
                self.out.push(0xcb);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::String(s) => {
                let bytes = s.as_bytes();
                self.header(
                    bytes.len(),
                    Some((0xa0, 31)),
                    [Some(0xd9), Some(0xda), Some(0xdb)],
                );
                self.out.extend_from_slice(bytes);
            }
            Value::Binary(b) => {
                self.header(b.len(), None, [Some(0xc4), Some(0xc5), Some(0xc6)]);
                self.out.extend_from_slice(b);
            }
            Value::Array(items) => {
                self.header(
                    items.len(),
                    Some((0x90, 15)),
                    [None, Some(0xdc), Some(0xdd)],
                );
                for item in items {
                    self.value(item);
                }
            }
            Value::Map(entries) => {
                self.header(
                    entries.len(),
                    Some((0x80, 15)),
                    [None, Some(0xde), Some(0xdf)],
                );
                for (k, item) in entries {
                    self.value(k);
                    self.value(item);
                }
            }
            Value::Ext(ty, data) => {
                let fix = match data.len() {
                    1 => Some(0xd4),
                    2 => Some(0xd5),
                    4 => Some(0xd6),
                    8 => Some(0xd7),
                    16 => Some(0xd8),
                    _ => None,
                };
                match fix {
                    Some(marker) if self.pick(2) == 0 => self.out.push(marker),
                    _ => self.header(data.len(), None, [Some(0xc7), Some(0xc8), Some(0xc9)]),
                }
                self.out.push(*ty as u8);
                self.out.extend_from_slice(data);
            }
        }
    }
}

// --- Values shaped like batches ---------------------------------------------------------------

fn s(text: &str) -> Value {
    Value::from(text)
}

/// A string whose bytes are not UTF-8 (rmpv keeps it as a string that `as_str` refuses).
fn not_utf8() -> Value {
    rmpv::decode::read_value(&mut &[0xa3, b'G', 0xff, b'U'][..]).expect("a str3")
}

fn any_int() -> impl Strategy<Value = Value> + Clone {
    prop_oneof![
        (0u64..200).prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-40i64..0).prop_map(Value::from),
    ]
}

/// Any msgpack value, small: what a wrong-typed field or an unknown one holds.
fn junk() -> impl Strategy<Value = Value> + Clone {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any_int(),
        any::<f32>().prop_map(Value::F32),
        any::<f64>().prop_map(Value::F64),
        "[a-z_]{0,20}".prop_map(|t| s(&t)),
        Just(not_utf8()),
        vec(any::<u8>(), 0..20).prop_map(Value::Binary),
        (any::<i8>(), vec(any::<u8>(), 0..20)).prop_map(|(t, d)| Value::Ext(t, d)),
    ];
    leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

/// Mostly right, sometimes nil, sometimes anything. (An event has a dozen fields: the noise is
/// kept low enough for most events to decode.)
fn field(right: impl Strategy<Value = Value> + Clone + 'static) -> BoxedStrategy<Value> {
    prop_oneof![40 => right, 1 => Just(Value::Nil), 1 => junk()].boxed()
}

/// An array of `element`s, or sometimes of `noisy` ones (which may not decode).
fn array_of(
    element: BoxedStrategy<Value>,
    noisy: BoxedStrategy<Value>,
    len: std::ops::Range<usize>,
) -> BoxedStrategy<Value> {
    prop_oneof![
        6 => vec(element, len.clone()).prop_map(Value::Array),
        1 => vec(noisy, len).prop_map(Value::Array),
    ]
    .boxed()
}

fn hash() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => any::<u64>().prop_map(Value::from),
        2 => (i64::MIN..0).prop_map(Value::from),
        2 => vec(any::<u8>(), 0..40).prop_map(Value::Binary),
    ]
    .boxed()
}

fn noisy_hash() -> BoxedStrategy<Value> {
    prop_oneof![8 => hash(), 1 => junk()].boxed()
}

fn hashes(len: std::ops::Range<usize>) -> BoxedStrategy<Value> {
    array_of(hash(), noisy_hash(), len)
}

fn token() -> BoxedStrategy<Value> {
    prop_oneof![
        (0u32..200).prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
    ]
    .boxed()
}

fn noisy_token() -> BoxedStrategy<Value> {
    prop_oneof![
        12 => token(),
        1 => (1u64 << 32..u64::MAX).prop_map(Value::from),
        1 => (-5i64..0).prop_map(Value::from),
        1 => junk(),
    ]
    .boxed()
}

fn tokens() -> BoxedStrategy<Value> {
    let pair =
        |t: fn() -> BoxedStrategy<Value>| (t(), t()).prop_map(|(a, b)| Value::Array(vec![a, b]));
    let noisy_pair = prop_oneof![
        12 => pair(noisy_token),
        1 => vec(token(), 0..4).prop_map(Value::Array),
        1 => junk(),
    ];
    field(prop_oneof![
        3 => array_of(token(), noisy_token(), 0..24),
        1 => array_of(pair(token).boxed(), noisy_pair.boxed(), 0..12),
    ])
}

fn uint_field() -> BoxedStrategy<Value> {
    field(prop_oneof![
        30 => (0u32..70).prop_map(Value::from),
        10 => any::<u32>().prop_map(Value::from),
        1 => any_int(),
    ])
}

fn block_size() -> BoxedStrategy<Value> {
    field(prop_oneof![
        24 => (1u32..70).prop_map(Value::from),
        1 => Just(Value::from(0)),
        1 => any_int(),
    ])
}

fn string_field() -> BoxedStrategy<Value> {
    field(prop_oneof![
        40 => prop::sample::select(vec!["GPU", "CPU", "lora-a", "full_attention", "LOCAL", ""])
            .prop_map(s),
        1 => Just(not_utf8()),
    ])
}

/// One untagged key of vLLM's per-block `extra_keys`.
fn extra_key() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => prop::sample::select(vec!["lora-a", "lora-b", "salt", "tenant"]).prop_map(s),
        3 => ("[a-z0-9]{1,8}", any_int()).prop_map(|(id, off)| Value::Array(vec![s(&id), off])),
        1 => vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        1 => Just(not_utf8()),
        1 => (junk(), junk()).prop_map(|(a, b)| Value::Array(vec![a, b])),
        1 => junk(),
    ]
    .boxed()
}

fn extra_entry() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => Just(Value::Nil),
        6 => vec(extra_key(), 0..5).prop_map(Value::Array),
        1 => junk(),
    ]
    .boxed()
}

/// Block hashes and `extra_keys` (one entry per hash more often than not).
fn hashes_and_extra() -> BoxedStrategy<(Value, Value)> {
    prop_oneof![
        3 => (0usize..5)
            .prop_flat_map(|n| (hashes(n..n + 1), vec(extra_entry(), n)))
            .prop_map(|(h, e)| (h, Value::Array(e))),
        2 => (field(hashes(0..6)), Just(Value::Nil)),
        1 => (
            field(hashes(0..6)),
            field(vec(extra_entry(), 0..5).prop_map(Value::Array)),
        ),
    ]
    .boxed()
}

/// BlockStored's fields in msgspec declaration order, by name (`cache_salt`, SGLang's, has no
/// position).
fn stored_fields() -> impl Strategy<Value = Vec<(&'static str, Value)>> {
    (
        hashes_and_extra(),
        field(hash()),
        tokens(),
        block_size(),
        uint_field(),
        string_field(),
        string_field(),
        uint_field(),
        string_field(),
        uint_field(),
        (string_field(), string_field()),
    )
        .prop_map(
            |(
                (hashes, extra),
                parent,
                tokens,
                block_size,
                lora_id,
                medium,
                lora_name,
                group_idx,
                kind,
                window,
                (locality, salt),
            )| {
                vec![
                    ("block_hashes", hashes),
                    ("parent_block_hash", parent),
                    ("token_ids", tokens),
                    ("block_size", block_size),
                    ("lora_id", lora_id),
                    ("medium", medium),
                    ("lora_name", lora_name),
                    ("extra_keys", extra),
                    ("group_idx", group_idx),
                    ("kv_cache_spec_kind", kind),
                    ("kv_cache_spec_sliding_window", window),
                    ("locality", locality),
                    ("cache_salt", salt),
                ]
            },
        )
}

fn removed_fields() -> impl Strategy<Value = Vec<(&'static str, Value)>> {
    (
        field(hashes(0..6)),
        string_field(),
        uint_field(),
        string_field(),
    )
        .prop_map(|(hashes, medium, group_idx, locality)| {
            vec![
                ("block_hashes", hashes),
                ("medium", medium),
                ("group_idx", group_idx),
                ("locality", locality),
            ]
        })
}

fn tag() -> BoxedStrategy<Value> {
    prop_oneof![
        12 => Just(s("BlockStored")),
        8 => Just(s("BlockRemoved")),
        2 => Just(s("AllBlocksCleared")),
        1 => Just(s("BlockMoved")),
        1 => Just(not_utf8()),
        1 => junk(),
    ]
    .boxed()
}

/// The fields a tag's event would carry (any event's, for a tag we do not know).
fn fields_for(tag: &Value) -> BoxedStrategy<Vec<(&'static str, Value)>> {
    match tag.as_str() {
        Some("BlockStored") => prop_oneof![20 => stored_fields(), 1 => removed_fields()].boxed(),
        Some("BlockRemoved") => prop_oneof![20 => removed_fields(), 1 => stored_fields()].boxed(),
        Some("AllBlocksCleared") => Just(Vec::new()).boxed(),
        _ => prop_oneof![stored_fields(), removed_fields()].boxed(),
    }
}

/// An event array-encoded: the tag, a prefix of the positional fields, maybe fields we do not
/// know after them.
fn array_event() -> BoxedStrategy<Value> {
    tag()
        .prop_flat_map(|tag| {
            let fields = fields_for(&tag);
            // Mostly every required field (the first four), sometimes fewer.
            let keep = prop_oneof![8 => 4usize..14, 1 => 0usize..4];
            (Just(tag), fields, keep, vec(junk(), 0..3))
        })
        .prop_map(|(tag, fields, keep, trailing)| {
            // Positional: every field but SGLang's `cache_salt`.
            let positional = fields
                .into_iter()
                .filter(|(name, _)| *name != "cache_salt")
                .map(|(_, v)| v);
            let mut items = vec![tag];
            items.extend(positional.take(keep));
            // Trailing unknown fields only after a full set, as engines add them.
            if items.len() == 13 || items.len() == 5 || items.len() == 1 {
                items.extend(trailing);
            }
            Value::Array(items)
        })
        .boxed()
}

/// An event map-encoded: a subset of its fields in any order, the `"type"` entry (maybe missing,
/// repeated or not a string), keys we do not know, repeated keys.
fn map_event() -> BoxedStrategy<Value> {
    tag()
        .prop_flat_map(|tag| {
            let fields = fields_for(&tag);
            // How many `"type"` entries hold the tag, and how many something else.
            let types = prop_oneof![
                24 => Just((1, 0)),
                1 => Just((0, 0)),
                1 => Just((2, 0)),
                2 => Just((1, 1)),
            ];
            (
                Just(tag),
                fields,
                vec(prop::bool::weighted(0.9), 13),
                vec((junk(), junk()), 0..3),
                types,
                junk(),
                proptest::option::of((any::<prop::sample::Index>(), junk())),
            )
        })
        .prop_flat_map(
            |(tag, fields, keep, unknown, (tags, not_tags), not_tag, repeat)| {
                let mut entries: Vec<(Value, Value)> = fields
                    .into_iter()
                    .zip(keep)
                    .filter(|(_, keep)| *keep)
                    .map(|((name, v), _)| (s(name), v))
                    .collect();
                // A repeated key: the last one counts.
                if let Some((at, v)) = repeat
                    && !entries.is_empty()
                {
                    let key = entries[at.index(entries.len())].0.clone();
                    entries.push((key, v));
                }
                entries.extend((0..tags).map(|_| (s("type"), tag.clone())));
                entries.extend((0..not_tags).map(|_| (s("type"), not_tag.clone())));
                entries.extend(unknown);
                entries.push((s("session_id"), s("chat-1")));
                Just(entries).prop_shuffle().prop_map(Value::Map)
            },
        )
        .boxed()
}

fn event() -> BoxedStrategy<Value> {
    prop_oneof![10 => array_event(), 10 => map_event(), 1 => junk()].boxed()
}

fn dp_rank() -> BoxedStrategy<Option<Value>> {
    prop_oneof![
        4 => Just(None),
        4 => Just(Some(Value::Nil)),
        8 => any::<DpRank>().prop_map(|r| Some(Value::from(r))),
        1 => any_int().prop_map(Some),
        1 => junk().prop_map(Some),
    ]
    .boxed()
}

fn batch() -> BoxedStrategy<Value> {
    let ts = prop_oneof![
        12 => any::<f64>().prop_map(Value::F64),
        2 => any::<f32>().prop_map(Value::F32),
        2 => any_int(),
        1 => junk(),
    ];
    let events = prop_oneof![24 => vec(event(), 0..5).prop_map(Value::Array), 1 => junk()];
    let whole = (ts, events, dp_rank(), vec(junk(), 0..2)).prop_map(|(ts, events, dp, extra)| {
        let mut items = vec![ts, events];
        if let Some(dp) = dp {
            items.push(dp);
            items.extend(extra);
        }
        Value::Array(items)
    });
    prop_oneof![
        40 => whole,
        1 => vec(junk(), 0..2).prop_map(Value::Array),
        1 => junk(),
    ]
    .boxed()
}

// --- The comparison ----------------------------------------------------------------------------

/// A batch decoding's outcome, comparable (`ts` by its bits: it may be NaN).
type Outcome = Result<(u64, Vec<EngineKvEvent>, Option<DpRank>, Vec<ProtocolError>), ProtocolError>;

fn outcome(decoded: Result<EngineEventBatch, ProtocolError>) -> Outcome {
    decoded.map(|b| (b.ts.to_bits(), b.events, b.dp_rank, b.errors))
}

fn same_as_reference(payload: &[u8]) -> Result<(), TestCaseError> {
    let new = outcome(decode_event_batch(payload));
    let old = outcome(zmq_reference::decode_event_batch(payload));
    prop_assert_eq!(new, old, "payload {:02x?}", payload);
    Ok(())
}

/// Ways to damage a payload.
#[derive(Debug, Clone)]
enum Damage {
    CutAt(usize),
    Set(usize, u8),
    Insert(usize, u8),
    Append(Vec<u8>),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<usize>().prop_map(Damage::CutAt),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Damage::Set(at, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Damage::Insert(at, b)),
        vec(any::<u8>(), 1..4).prop_map(Damage::Append),
    ]
}

fn damaged(mut bytes: Vec<u8>, damage: &Damage) -> Vec<u8> {
    let len = bytes.len().max(1);
    match damage {
        Damage::CutAt(at) => bytes.truncate(at % len),
        Damage::Set(at, b) => {
            if let Some(byte) = bytes.get_mut(at % len) {
                *byte = *b;
            }
        }
        Damage::Insert(at, b) => bytes.insert(at % len, *b),
        Damage::Append(tail) => bytes.extend_from_slice(tail),
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Generated batches decode exactly as the value-tree decoder decoded them.
    #[test]
    fn decodes_as_the_value_tree_did(batch in batch(), seed in any::<u64>()) {
        same_as_reference(&Encoder::encode(&batch, seed))?;
    }

    /// So do the same batches cut short or with a byte changed, inserted or appended.
    #[test]
    fn damaged_batches_fail_as_the_value_tree_did(
        batch in batch(),
        seed in any::<u64>(),
        damage in damage(),
    ) {
        same_as_reference(&damaged(Encoder::encode(&batch, seed), &damage))?;
    }

    /// And arbitrary bytes.
    #[test]
    fn arbitrary_bytes_as_the_value_tree_did(bytes in vec(any::<u8>(), 0..64)) {
        same_as_reference(&bytes)?;
    }
}

/// The generator reaches what it is meant to: events that decode, in both encodings, with
/// bigrams, byte and negative hashes and extra keys; events that do not; whole batches that fail.
#[test]
fn the_generator_covers_the_decoder() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = (batch(), any::<u64>());
    let (mut stored, mut removed, mut event_errors, mut batch_errors) = (0, 0, 0, 0);
    let (mut bigrams, mut extra, mut bytes, mut reserved) = (0, 0, 0, 0);
    for _ in 0..2000 {
        let (batch, seed) = strategy.new_tree(&mut runner).expect("a batch").current();
        let payload = Encoder::encode(&batch, seed);
        match decode_event_batch(&payload) {
            Err(_) => batch_errors += 1,
            Ok(b) => {
                event_errors += b.errors.len();
                for e in &b.events {
                    match e {
                        EngineKvEvent::BlockStored(st) => {
                            stored += 1;
                            extra += usize::from(!st.extra_keys.is_empty());
                        }
                        EngineKvEvent::BlockRemoved(_) => removed += 1,
                        EngineKvEvent::AllBlocksCleared => {}
                    }
                }
            }
        }
        bigrams += usize::from(contains(&batch, &bigram_tokens));
        bytes += usize::from(contains(&batch, &|v| matches!(v, Value::Binary(_))));
        reserved += usize::from(payload.contains(&0xc1));
    }
    let counts = [
        ("BlockStored decoded", stored),
        ("BlockRemoved decoded", removed),
        ("BlockStored with extra_keys decoded", extra),
        ("event errors", event_errors),
        ("batch errors", batch_errors),
        ("payloads with bigrams", bigrams),
        ("payloads with bytes", bytes),
        ("payloads with the reserved marker", reserved),
    ];
    for (what, n) in counts {
        assert!(n >= 50, "only {n} of {what} in 2000 batches: {counts:?}");
    }
}

/// An array of `[integer, integer]` pairs (the first one at least), as SGLang's bigram tokens.
fn bigram_tokens(v: &Value) -> bool {
    let int_pair = |v: &Value| {
        let Value::Array(pair) = v else { return false };
        matches!(&pair[..], [Value::Integer(_), Value::Integer(_)])
    };
    matches!(v, Value::Array(items) if items.first().is_some_and(int_pair))
}

/// Whether `v` or a value inside it is one `pred` accepts.
fn contains(v: &Value, pred: &dyn Fn(&Value) -> bool) -> bool {
    pred(v)
        || match v {
            Value::Array(items) => items.iter().any(|i| contains(i, pred)),
            Value::Map(entries) => entries
                .iter()
                .any(|(k, v)| contains(k, pred) || contains(v, pred)),
            _ => false,
        }
}

// --- Hostile payloads --------------------------------------------------------------------------

fn pack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}

fn not_msgpack(payload: &[u8]) -> bool {
    matches!(
        decode_event_batch(payload),
        Err(ProtocolError::KvEvent(m)) if m.starts_with("payload is not msgpack: ")
    )
}

fn realistic() -> Vec<u8> {
    let tokens = Value::Array((0..64u32).map(|t| Value::from(t * 4099)).collect());
    pack(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![
            Value::Map(vec![
                (s("type"), s("BlockStored")),
                (
                    s("block_hashes"),
                    Value::Array(vec![Value::from(u64::MAX), Value::from(-3)]),
                ),
                (s("token_ids"), tokens),
                (s("block_size"), Value::from(32)),
                (s("lora_name"), s("lora-a")),
                (
                    s("extra_keys"),
                    Value::Array(vec![
                        Value::Array(vec![
                            s("lora-a"),
                            Value::Array(vec![s("img"), Value::from(-2)]),
                        ]),
                        Value::Nil,
                    ]),
                ),
            ]),
            Value::Array(vec![
                s("BlockRemoved"),
                Value::Array(vec![Value::Binary(vec![1; 32])]),
            ]),
        ]),
        Value::from(1),
    ]))
}

/// Every proper prefix of a payload is an error about the payload as a whole, never a batch of
/// whatever events came before the cut.
#[test]
fn every_truncation_is_an_error() {
    let payload = realistic();
    let whole = decode_event_batch(&payload).expect("decodes");
    assert_eq!(whole.events.len(), 2, "{whole:?}");
    assert!(whole.errors.is_empty(), "{whole:?}");
    for cut in 0..payload.len() {
        let prefix = &payload[..cut];
        assert!(
            not_msgpack(prefix),
            "cut at {cut}: {:?}",
            decode_event_batch(prefix)
        );
        assert_eq!(
            decode_event_batch(prefix),
            zmq_reference::decode_event_batch(prefix),
            "cut at {cut}"
        );
    }
}

/// Where a value is put into a payload to be replaced by other bytes: an extension value no
/// generated payload holds.
fn hole() -> Value {
    Value::Ext(0x55, b"HOLE".to_vec())
}

/// The bytes of `batch` up to its [`hole`], then `bytes` in its place: the rest is cut off.
fn cut_at_hole(batch: &Value, bytes: &[u8]) -> Vec<u8> {
    let packed = pack(batch);
    let marker = pack(&hole());
    let at = packed
        .windows(marker.len())
        .position(|w| w == &marker[..])
        .expect("the batch has a hole");
    [&packed[..at], bytes].concat()
}

/// A length header claiming far more than the payload holds fails where the bytes end, wherever
/// it sits (the batch, the events, an event, a field, an element): an error about the payload as
/// a whole, not about that event, with no allocation of the claimed size (capacities are capped
/// by the bytes left).
#[test]
fn huge_declared_lengths_are_errors() {
    let huge: [&[u8]; 8] = [
        &[0xdd, 0xff, 0xff, 0xff, 0xff],       // array32
        &[0xdf, 0xff, 0xff, 0xff, 0xff],       // map32
        &[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'], // str32
        &[0xc6, 0xff, 0xff, 0xff, 0xff, 0],    // bin32
        &[0xc9, 0xff, 0xff, 0xff, 0xff, 1],    // ext32
        &[0xdc, 0xff, 0xff, 0x01],             // array16
        &[0xde, 0xff, 0xff, 0xc0],             // map16
        &[0xda, 0xff, 0xff],                   // str16
    ];
    let batch = |events: Value| Value::Array(vec![Value::F64(0.0), events, Value::from(1)]);
    let stored = |hashes: Value, tokens: Value, extra: Value| {
        batch(Value::Array(vec![Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), hashes),
            (s("token_ids"), tokens),
            (s("block_size"), Value::from(1)),
            (s("extra_keys"), extra),
        ])]))
    };
    let one = || Value::Array(vec![Value::from(1)]);
    let places = [
        ("the batch", hole()),
        ("the events", batch(hole())),
        ("an event", batch(Value::Array(vec![hole()]))),
        ("token_ids", stored(one(), hole(), Value::Nil)),
        (
            "a token",
            stored(
                one(),
                Value::Array(vec![Value::from(1), hole()]),
                Value::Nil,
            ),
        ),
        (
            "a bigram's token",
            stored(
                one(),
                Value::Array(vec![Value::Array(vec![Value::from(1), hole()])]),
                Value::Nil,
            ),
        ),
        ("block_hashes", stored(hole(), one(), Value::Nil)),
        (
            "a block hash",
            stored(Value::Array(vec![hole()]), one(), Value::Nil),
        ),
        ("extra_keys", stored(one(), one(), hole())),
        (
            "an extra key",
            stored(one(), one(), Value::Array(vec![Value::Array(vec![hole()])])),
        ),
    ];
    for (place, payload) in &places {
        for header in huge {
            let bytes = cut_at_hole(payload, header);
            assert!(
                not_msgpack(&bytes),
                "{place}, {header:02x?}: {:?}",
                decode_event_batch(&bytes)
            );
            assert_eq!(
                decode_event_batch(&bytes),
                zmq_reference::decode_event_batch(&bytes),
                "{place}, {header:02x?}"
            );
        }
    }
}

/// Nesting: accepted up to exactly where rmpv accepted it (each level of array costs two of
/// [`MAX_DEPTH`], a string at the bottom three), refused past it, and a very deep payload is
/// refused without recursing through it.
#[test]
fn nesting_stops_at_the_depth_limit() {
    let leaves: [(&str, &[u8]); 5] = [
        ("nil", &[0xc0]),
        ("integer", &[0x07]),
        ("bytes", &[0xc4, 0x01, 0xaa]),
        ("string", &[0xa1, b'x']),
        ("extension", &[0xd4, 0x01, 0xaa]),
    ];
    for (what, leaf) in leaves {
        let mut deepest_accepted = None;
        for levels in 0..=MAX_DEPTH {
            let payload = [vec![0x91; levels], leaf.to_vec()].concat();
            let mut rd = &payload[..];
            let rmpv_accepts = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).is_ok();
            // Whatever the shape error, a payload that nests too deep is not msgpack.
            assert_eq!(
                !not_msgpack(&payload),
                rmpv_accepts,
                "{what} under {levels} arrays"
            );
            assert_eq!(
                decode_event_batch(&payload),
                zmq_reference::decode_event_batch(&payload),
                "{what} under {levels} arrays"
            );
            if rmpv_accepts {
                deepest_accepted = Some(levels);
            }
        }
        // Two levels a container, one a scalar, two bytes, three a string or an extension.
        let expected = match what {
            "string" | "extension" => (MAX_DEPTH - 3) / 2,
            _ => (MAX_DEPTH - 1) / 2,
        };
        assert_eq!(deepest_accepted, Some(expected), "{what}");
    }
    // Inside a real event too: a BlockStored's token_ids nesting arrays past the limit.
    let mut inner = Value::from(1);
    for _ in 0..MAX_DEPTH {
        inner = Value::Array(vec![inner]);
    }
    let payload = pack(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![]),
            Value::Nil,
            inner,
            Value::from(1),
        ])]),
    ]));
    assert!(not_msgpack(&payload), "{:?}", decode_event_batch(&payload));
    assert_eq!(
        decode_event_batch(&payload),
        zmq_reference::decode_event_batch(&payload)
    );
    // A million levels: refused at the limit, not by overflowing the stack.
    assert!(not_msgpack(&vec![0x91; 1_000_000]));
    assert!(not_msgpack(&vec![0x81; 1_000_000]));
}
