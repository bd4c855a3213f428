//! envd's binary protobuf codec: the messages of `process.Process` and
//! `filesystem.Filesystem` (field numbers and types of envd's `spec/envd/process/
//! process.proto` and `spec/envd/filesystem/filesystem.proto`, written here as tables) and
//! a transcoder between their binary encoding and their canonical proto3 JSON mapping
//! (<https://protobuf.dev/programming-guides/json/>).
//!
//! **One message model, two codecs.** The handlers of [`super::process`],
//! [`super::filesystem`] and [`super::watch`] read and write the JSON mapping only.
//! [`codec`], a layer on the two Connect routes, turns an `application/proto` /
//! `application/connect+proto` call into the same call in JSON (request message
//! decoded from binary, re-encoded as JSON; `Content-Type` rewritten) and the answer
//! back: each message the handler sends is encoded as binary; Connect errors (unary error
//! bodies and end-of-stream envelopes) stay JSON in both codecs, as the Connect protocol
//! has it.
//!
//! Wire handling ([`decode`], [`encode`]): varint, 64-bit, length-delimited and 32-bit
//! fields; unknown fields are skipped, groups refused; `int64` is a JSON string, `bytes`
//! base64, enums their names (an unknown number stays a number), `map<string, string>` an
//! object, `google.protobuf.Timestamp` an RFC 3339 string. A field that appears twice keeps
//! the last value (messages are not merged). Decoding errors are `invalid_argument`.
use super::connect::{envelope, ConnectError, END_STREAM, MAX_MESSAGE_BYTES};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use futures::StreamExt;
use prost::encoding::{decode_varint, encode_varint};
use serde_json::{Map, Value};

/// Type of a field (repeated-ness is [`Field::repeated`]).
#[derive(Debug, Clone, Copy)]
pub enum Ty {
    /// `uint32` (varint).
    U32,
    /// `sint32` (zigzag varint).
    S32,
    /// `int64` (varint; a string in JSON).
    I64,
    /// `bool`.
    Bool,
    /// `string` (UTF-8).
    Str,
    /// `bytes` (base64 in JSON).
    Bytes,
    /// An enum: its values' numbers and names.
    Enum(&'static [(i32, &'static str)]),
    /// A message.
    Msg(&'static Schema),
    /// `map<string, string>` (entries: key 1, value 2).
    MapStr,
    /// `google.protobuf.Timestamp` (seconds 1, nanos 2; RFC 3339 in JSON).
    Timestamp,
}

/// One field of a message.
#[derive(Debug)]
pub struct Field {
    /// Field number.
    pub num: u32,
    /// JSON name (lowerCamelCase of the proto name).
    pub json: &'static str,
    /// Type.
    pub ty: Ty,
    /// `repeated`.
    pub repeated: bool,
}

/// A message type: its full name and fields.
#[derive(Debug)]
pub struct Schema {
    /// Full proto name, e.g. `process.StartRequest`.
    pub name: &'static str,
    /// Fields, any order.
    pub fields: &'static [Field],
}

const fn f(num: u32, json: &'static str, ty: Ty) -> Field {
    Field {
        num,
        json,
        ty,
        repeated: false,
    }
}

const fn rep(num: u32, json: &'static str, ty: Ty) -> Field {
    Field {
        num,
        json,
        ty,
        repeated: true,
    }
}

macro_rules! schema {
    ($id:ident, $name:literal, [$($field:expr),* $(,)?]) => {
        #[doc = concat!("`", $name, "`.")]
        pub static $id: Schema = Schema { name: $name, fields: &[$($field),*] };
    };
}

// process.proto
schema!(EMPTY, "(empty message)", []);
schema!(
    PTY_SIZE,
    "process.PTY.Size",
    [f(1, "cols", Ty::U32), f(2, "rows", Ty::U32)]
);
schema!(PTY, "process.PTY", [f(1, "size", Ty::Msg(&PTY_SIZE))]);
schema!(
    PROCESS_CONFIG,
    "process.ProcessConfig",
    [
        f(1, "cmd", Ty::Str),
        rep(2, "args", Ty::Str),
        f(3, "envs", Ty::MapStr),
        f(4, "cwd", Ty::Str),
    ]
);
schema!(
    PROCESS_INFO,
    "process.ProcessInfo",
    [
        f(1, "config", Ty::Msg(&PROCESS_CONFIG)),
        f(2, "pid", Ty::U32),
        f(3, "tag", Ty::Str),
    ]
);
schema!(
    LIST_RESPONSE,
    "process.ListResponse",
    [rep(1, "processes", Ty::Msg(&PROCESS_INFO))]
);
schema!(
    START_REQUEST,
    "process.StartRequest",
    [
        f(1, "process", Ty::Msg(&PROCESS_CONFIG)),
        f(2, "pty", Ty::Msg(&PTY)),
        f(3, "tag", Ty::Str),
        f(4, "stdin", Ty::Bool),
    ]
);
schema!(
    PROCESS_SELECTOR,
    "process.ProcessSelector",
    [f(1, "pid", Ty::U32), f(2, "tag", Ty::Str)]
);
schema!(
    UPDATE_REQUEST,
    "process.UpdateRequest",
    [
        f(1, "process", Ty::Msg(&PROCESS_SELECTOR)),
        f(2, "pty", Ty::Msg(&PTY)),
    ]
);
schema!(
    START_EVENT,
    "process.ProcessEvent.StartEvent",
    [f(1, "pid", Ty::U32)]
);
schema!(
    DATA_EVENT,
    "process.ProcessEvent.DataEvent",
    [
        f(1, "stdout", Ty::Bytes),
        f(2, "stderr", Ty::Bytes),
        f(3, "pty", Ty::Bytes),
    ]
);
schema!(
    END_EVENT,
    "process.ProcessEvent.EndEvent",
    [
        f(1, "exitCode", Ty::S32),
        f(2, "exited", Ty::Bool),
        f(3, "status", Ty::Str),
        f(4, "error", Ty::Str),
    ]
);
schema!(
    PROCESS_EVENT,
    "process.ProcessEvent",
    [
        f(1, "start", Ty::Msg(&START_EVENT)),
        f(2, "data", Ty::Msg(&DATA_EVENT)),
        f(3, "end", Ty::Msg(&END_EVENT)),
        f(4, "keepalive", Ty::Msg(&EMPTY)),
    ]
);
schema!(
    START_RESPONSE,
    "process.StartResponse",
    [f(1, "event", Ty::Msg(&PROCESS_EVENT))]
);
schema!(
    PROCESS_INPUT,
    "process.ProcessInput",
    [f(1, "stdin", Ty::Bytes), f(2, "pty", Ty::Bytes)]
);
schema!(
    SEND_INPUT_REQUEST,
    "process.SendInputRequest",
    [
        f(1, "process", Ty::Msg(&PROCESS_SELECTOR)),
        f(2, "input", Ty::Msg(&PROCESS_INPUT)),
    ]
);
schema!(
    STREAM_INPUT_START,
    "process.StreamInputRequest.StartEvent",
    [f(1, "process", Ty::Msg(&PROCESS_SELECTOR))]
);
schema!(
    STREAM_INPUT_DATA,
    "process.StreamInputRequest.DataEvent",
    [f(2, "input", Ty::Msg(&PROCESS_INPUT))]
);
schema!(
    STREAM_INPUT_REQUEST,
    "process.StreamInputRequest",
    [
        f(1, "start", Ty::Msg(&STREAM_INPUT_START)),
        f(2, "data", Ty::Msg(&STREAM_INPUT_DATA)),
        f(3, "keepalive", Ty::Msg(&EMPTY)),
    ]
);
const SIGNALS: &[(i32, &str)] = &[
    (0, "SIGNAL_UNSPECIFIED"),
    (15, "SIGNAL_SIGTERM"),
    (9, "SIGNAL_SIGKILL"),
];
schema!(
    SEND_SIGNAL_REQUEST,
    "process.SendSignalRequest",
    [
        f(1, "process", Ty::Msg(&PROCESS_SELECTOR)),
        f(2, "signal", Ty::Enum(SIGNALS)),
    ]
);
schema!(
    SELECTOR_REQUEST,
    "process.{Connect,CloseStdin}Request",
    [f(1, "process", Ty::Msg(&PROCESS_SELECTOR))]
);

// filesystem.proto
const FILE_TYPES: &[(i32, &str)] = &[
    (0, "FILE_TYPE_UNSPECIFIED"),
    (1, "FILE_TYPE_FILE"),
    (2, "FILE_TYPE_DIRECTORY"),
    (3, "FILE_TYPE_SYMLINK"),
];
const EVENT_TYPES: &[(i32, &str)] = &[
    (0, "EVENT_TYPE_UNSPECIFIED"),
    (1, "EVENT_TYPE_CREATE"),
    (2, "EVENT_TYPE_WRITE"),
    (3, "EVENT_TYPE_REMOVE"),
    (4, "EVENT_TYPE_RENAME"),
    (5, "EVENT_TYPE_CHMOD"),
];
schema!(
    ENTRY_INFO,
    "filesystem.EntryInfo",
    [
        f(1, "name", Ty::Str),
        f(2, "type", Ty::Enum(FILE_TYPES)),
        f(3, "path", Ty::Str),
        f(4, "size", Ty::I64),
        f(5, "mode", Ty::U32),
        f(6, "permissions", Ty::Str),
        f(7, "owner", Ty::Str),
        f(8, "group", Ty::Str),
        f(9, "modifiedTime", Ty::Timestamp),
        f(10, "symlinkTarget", Ty::Str),
        f(11, "metadata", Ty::MapStr),
    ]
);
schema!(
    PATH_REQUEST,
    "filesystem.{Stat,MakeDir,Remove,ListDir}Request",
    [f(1, "path", Ty::Str), f(2, "depth", Ty::U32)]
);
schema!(
    MOVE_REQUEST,
    "filesystem.MoveRequest",
    [f(1, "source", Ty::Str), f(2, "destination", Ty::Str)]
);
schema!(
    ENTRY_RESPONSE,
    "filesystem.{Stat,MakeDir,Move}Response",
    [f(1, "entry", Ty::Msg(&ENTRY_INFO))]
);
schema!(
    LIST_DIR_RESPONSE,
    "filesystem.ListDirResponse",
    [rep(1, "entries", Ty::Msg(&ENTRY_INFO))]
);
schema!(
    WATCH_REQUEST,
    "filesystem.{WatchDir,CreateWatcher}Request",
    [
        f(1, "path", Ty::Str),
        f(2, "recursive", Ty::Bool),
        f(3, "includeEntry", Ty::Bool),
        f(4, "allowNetworkMounts", Ty::Bool),
    ]
);
schema!(
    FILESYSTEM_EVENT,
    "filesystem.FilesystemEvent",
    [
        f(1, "name", Ty::Str),
        f(2, "type", Ty::Enum(EVENT_TYPES)),
        f(3, "entry", Ty::Msg(&ENTRY_INFO)),
    ]
);
schema!(
    WATCH_DIR_RESPONSE,
    "filesystem.WatchDirResponse",
    [
        f(1, "start", Ty::Msg(&EMPTY)),
        f(2, "filesystem", Ty::Msg(&FILESYSTEM_EVENT)),
        f(3, "keepalive", Ty::Msg(&EMPTY)),
    ]
);
schema!(
    WATCHER_ID,
    "filesystem.{CreateWatcherResponse,GetWatcherEventsRequest,RemoveWatcherRequest}",
    [f(1, "watcherId", Ty::Str)]
);
schema!(
    WATCHER_EVENTS,
    "filesystem.GetWatcherEventsResponse",
    [rep(1, "events", Ty::Msg(&FILESYSTEM_EVENT))]
);

/// One RPC: its request and response messages and whether the request is a stream
/// (client stream) and the response a stream (server stream).
#[derive(Debug, Clone, Copy)]
pub struct Method {
    /// Request message.
    pub request: &'static Schema,
    /// Response message.
    pub response: &'static Schema,
    /// The call uses envelopes (`application/connect+proto`): a client or server stream.
    pub streaming: bool,
}

/// The method at `path` (`/process.Process/Start`, …), if Sandlot serves it.
pub fn method(path: &str) -> Option<Method> {
    let m = |request, response, streaming| {
        Some(Method {
            request,
            response,
            streaming,
        })
    };
    match path {
        "/process.Process/Start" => m(&START_REQUEST, &START_RESPONSE, true),
        "/process.Process/Connect" => m(&SELECTOR_REQUEST, &START_RESPONSE, true),
        "/process.Process/StreamInput" => m(&STREAM_INPUT_REQUEST, &EMPTY, true),
        "/process.Process/List" => m(&EMPTY, &LIST_RESPONSE, false),
        "/process.Process/SendInput" => m(&SEND_INPUT_REQUEST, &EMPTY, false),
        "/process.Process/CloseStdin" => m(&SELECTOR_REQUEST, &EMPTY, false),
        "/process.Process/SendSignal" => m(&SEND_SIGNAL_REQUEST, &EMPTY, false),
        "/process.Process/Update" => m(&UPDATE_REQUEST, &EMPTY, false),
        "/filesystem.Filesystem/Stat" | "/filesystem.Filesystem/MakeDir" => {
            m(&PATH_REQUEST, &ENTRY_RESPONSE, false)
        }
        "/filesystem.Filesystem/Remove" => m(&PATH_REQUEST, &EMPTY, false),
        "/filesystem.Filesystem/ListDir" => m(&PATH_REQUEST, &LIST_DIR_RESPONSE, false),
        "/filesystem.Filesystem/Move" => m(&MOVE_REQUEST, &ENTRY_RESPONSE, false),
        "/filesystem.Filesystem/WatchDir" => m(&WATCH_REQUEST, &WATCH_DIR_RESPONSE, true),
        "/filesystem.Filesystem/CreateWatcher" => m(&WATCH_REQUEST, &WATCHER_ID, false),
        "/filesystem.Filesystem/GetWatcherEvents" => m(&WATCHER_ID, &WATCHER_EVENTS, false),
        "/filesystem.Filesystem/RemoveWatcher" => m(&WATCHER_ID, &EMPTY, false),
        _ => None,
    }
}

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

fn take<'a>(buf: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if buf.len() < n {
        return Err(format!(
            "{what}: truncated ({n} bytes announced, {} left)",
            buf.len()
        ));
    }
    let (a, b) = buf.split_at(n);
    *buf = b;
    Ok(a)
}

fn varint(buf: &mut &[u8], what: &str) -> Result<u64, String> {
    decode_varint(buf).map_err(|_| format!("{what}: bad varint"))
}

fn enum_name(values: &[(i32, &str)], n: i32) -> Value {
    values
        .iter()
        .find(|(v, _)| *v == n)
        .map(|(_, name)| Value::from(*name))
        .unwrap_or_else(|| Value::from(n))
}

fn scalar(ty: Ty, wire: u64, buf: &mut &[u8], what: &str) -> Result<Value, String> {
    let want = match ty {
        Ty::U32 | Ty::S32 | Ty::I64 | Ty::Bool | Ty::Enum(_) => VARINT,
        _ => LEN,
    };
    if wire != want {
        return Err(format!("{what}: wire type {wire}, expected {want}"));
    }
    Ok(match ty {
        Ty::U32 => Value::from(varint(buf, what)? as u32),
        Ty::S32 => {
            let n = varint(buf, what)? as u32;
            Value::from(((n >> 1) as i32) ^ -((n & 1) as i32))
        }
        Ty::I64 => Value::from((varint(buf, what)? as i64).to_string()),
        Ty::Bool => Value::from(varint(buf, what)? != 0),
        Ty::Enum(values) => enum_name(values, varint(buf, what)? as i32),
        Ty::Str | Ty::Bytes | Ty::Msg(_) | Ty::MapStr | Ty::Timestamp => {
            let n = usize::try_from(varint(buf, what)?).map_err(|_| format!("{what}: length"))?;
            let raw = take(buf, n, what)?;
            match ty {
                Ty::Str => Value::from(
                    std::str::from_utf8(raw).map_err(|_| format!("{what}: string is not UTF-8"))?,
                ),
                Ty::Bytes => Value::from(base64::engine::general_purpose::STANDARD.encode(raw)),
                Ty::Msg(s) => decode(s, raw)?,
                Ty::Timestamp => timestamp_json(raw, what)?,
                _ => unreachable!("map entries are decoded by the caller"),
            }
        }
    })
}

fn timestamp_json(mut raw: &[u8], what: &str) -> Result<Value, String> {
    let (mut secs, mut nanos) = (0i64, 0u32);
    while !raw.is_empty() {
        let key = varint(&mut raw, what)?;
        match (key >> 3, key & 7) {
            (1, VARINT) => secs = varint(&mut raw, what)? as i64,
            (2, VARINT) => nanos = varint(&mut raw, what)? as u32,
            (_, w) => skip(w, &mut raw, what)?,
        }
    }
    let t = chrono::DateTime::from_timestamp(secs, nanos)
        .ok_or_else(|| format!("{what}: timestamp out of range"))?;
    Ok(Value::from(
        t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true),
    ))
}

fn skip(wire: u64, buf: &mut &[u8], what: &str) -> Result<(), String> {
    match wire {
        VARINT => varint(buf, what).map(drop),
        FIXED64 => take(buf, 8, what).map(drop),
        FIXED32 => take(buf, 4, what).map(drop),
        LEN => {
            let n = usize::try_from(varint(buf, what)?).map_err(|_| format!("{what}: length"))?;
            take(buf, n, what).map(drop)
        }
        w => Err(format!("{what}: wire type {w} (groups) is not supported")),
    }
}

/// The JSON mapping of the binary message `raw` of type `schema`.
///
/// # Errors
/// A description of the first malformed field (truncated data, bad varint, wrong wire
/// type, a string that is not UTF-8, a field number 0, a group).
pub fn decode(schema: &Schema, mut raw: &[u8]) -> Result<Value, String> {
    let mut out = Map::new();
    while !raw.is_empty() {
        let key = varint(&mut raw, schema.name)?;
        let (num, wire) = (key >> 3, key & 7);
        if num == 0 || num > u64::from(u32::MAX >> 3) {
            return Err(format!("{}: field number {num}", schema.name));
        }
        let Some(field) = schema.fields.iter().find(|f| u64::from(f.num) == num) else {
            skip(wire, &mut raw, schema.name)?;
            continue;
        };
        let what = format!("{}.{}", schema.name, field.json);
        if let Ty::MapStr = field.ty {
            if wire != LEN {
                return Err(format!("{what}: wire type {wire}, expected 2"));
            }
            let n = usize::try_from(varint(&mut raw, &what)?).map_err(|_| what.clone())?;
            let entry = decode(&MAP_ENTRY, take(&mut raw, n, &what)?)?;
            let k = entry.get("key").and_then(Value::as_str).unwrap_or("");
            let v = entry.get("value").cloned().unwrap_or_else(|| "".into());
            let map = out
                .entry(field.json)
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(m) = map.as_object_mut() {
                m.insert(k.to_owned(), v);
            }
            continue;
        }
        let v = scalar(field.ty, wire, &mut raw, &what)?;
        if field.repeated {
            let arr = out
                .entry(field.json)
                .or_insert_with(|| Value::Array(vec![]));
            if let Some(a) = arr.as_array_mut() {
                a.push(v);
            }
        } else {
            out.insert(field.json.to_owned(), v);
        }
    }
    Ok(Value::Object(out))
}

schema!(
    MAP_ENTRY,
    "map<string, string> entry",
    [f(1, "key", Ty::Str), f(2, "value", Ty::Str)]
);

fn put_key(out: &mut Vec<u8>, num: u32, wire: u64) {
    encode_varint((u64::from(num) << 3) | wire, out);
}

fn put_len(out: &mut Vec<u8>, num: u32, raw: &[u8]) {
    put_key(out, num, LEN);
    encode_varint(raw.len() as u64, out);
    out.extend_from_slice(raw);
}

fn int_of(v: &Value, what: &str) -> Result<i64, String> {
    v.as_i64()
        .or_else(|| v.as_u64().map(|n| n as i64))
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .ok_or_else(|| format!("{what}: {v} is not an integer"))
}

fn put_value(out: &mut Vec<u8>, field: &Field, v: &Value, what: &str) -> Result<(), String> {
    let n = field.num;
    match field.ty {
        Ty::U32 => {
            let x = u32::try_from(int_of(v, what)?).map_err(|_| format!("{what}: not a uint32"))?;
            put_key(out, n, VARINT);
            encode_varint(u64::from(x), out);
        }
        Ty::S32 => {
            let x = i32::try_from(int_of(v, what)?).map_err(|_| format!("{what}: not an int32"))?;
            put_key(out, n, VARINT);
            encode_varint(u64::from(((x << 1) ^ (x >> 31)) as u32), out);
        }
        Ty::I64 => {
            put_key(out, n, VARINT);
            encode_varint(int_of(v, what)? as u64, out);
        }
        Ty::Bool => {
            put_key(out, n, VARINT);
            encode_varint(u64::from(v.as_bool().unwrap_or(false)), out);
        }
        Ty::Enum(values) => {
            let x = match v.as_str() {
                Some(s) => values
                    .iter()
                    .find(|(_, name)| *name == s)
                    .map(|(x, _)| *x)
                    .ok_or_else(|| format!("{what}: unknown enum value {s}"))?,
                None => i32::try_from(int_of(v, what)?).map_err(|_| what.to_owned())?,
            };
            put_key(out, n, VARINT);
            encode_varint(x as i64 as u64, out);
        }
        Ty::Str => {
            let s = v.as_str().ok_or_else(|| format!("{what}: not a string"))?;
            put_len(out, n, s.as_bytes());
        }
        Ty::Bytes => {
            let s = v.as_str().ok_or_else(|| format!("{what}: not a string"))?;
            let raw = base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| format!("{what}: not base64: {e}"))?;
            put_len(out, n, &raw);
        }
        Ty::Msg(s) => put_len(out, n, &encode(s, v)?),
        Ty::MapStr => {
            let m = v
                .as_object()
                .ok_or_else(|| format!("{what}: not an object"))?;
            for (k, val) in m {
                let mut e = Vec::new();
                put_len(&mut e, 1, k.as_bytes());
                let val = val
                    .as_str()
                    .ok_or_else(|| format!("{what}: not a string"))?;
                put_len(&mut e, 2, val.as_bytes());
                put_len(out, n, &e);
            }
        }
        Ty::Timestamp => {
            let s = v.as_str().ok_or_else(|| format!("{what}: not a string"))?;
            let t = chrono::DateTime::parse_from_rfc3339(s)
                .map_err(|e| format!("{what}: not RFC 3339: {e}"))?;
            let mut e = Vec::new();
            put_key(&mut e, 1, VARINT);
            encode_varint(t.timestamp() as u64, &mut e);
            put_key(&mut e, 2, VARINT);
            encode_varint(u64::from(t.timestamp_subsec_nanos()), &mut e);
            put_len(out, n, &e);
        }
    }
    Ok(())
}

/// The binary encoding of `v`, a JSON mapping of a `schema` message. Fields present in
/// `v` are written even when they hold their default (so a oneof member stays set);
/// `null` fields and JSON keys the schema lacks are left out.
///
/// # Errors
/// A description of a value of the wrong type (these are Sandlot's own messages, so an
/// error is a bug).
pub fn encode(schema: &Schema, v: &Value) -> Result<Vec<u8>, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{}: not a JSON object", schema.name))?;
    let mut out = Vec::new();
    for field in schema.fields {
        let Some(val) = obj.get(field.json).filter(|v| !v.is_null()) else {
            continue;
        };
        let what = format!("{}.{}", schema.name, field.json);
        if field.repeated {
            let arr = val
                .as_array()
                .ok_or_else(|| format!("{what}: not an array"))?;
            for item in arr {
                put_value(&mut out, field, item, &what)?;
            }
        } else {
            put_value(&mut out, field, val, &what)?;
        }
    }
    Ok(out)
}

/// The codec a Connect request's `Content-Type` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// `application/proto`.
    Unary,
    /// `application/connect+proto`.
    Stream,
}

fn proto_wire(req: &Request) -> Option<Wire> {
    let ct = req.headers().get(header::CONTENT_TYPE)?.to_str().ok()?;
    match ct.split(';').next()?.trim().to_ascii_lowercase().as_str() {
        "application/proto" => Some(Wire::Unary),
        "application/connect+proto" => Some(Wire::Stream),
        _ => None,
    }
}

fn bad(e: String) -> ConnectError {
    ConnectError::invalid(format!("request is not a valid protobuf message: {e}"))
}

/// The JSON message of one proto envelope's payload, as a JSON envelope.
fn envelope_to_json(m: &Method, flags: u8, payload: &[u8]) -> Result<Bytes, ConnectError> {
    if flags & super::connect::COMPRESSED != 0 {
        return Err(ConnectError::invalid(
            "compressed envelopes are not accepted (send Connect-Content-Encoding identity)",
        ));
    }
    if flags != 0 {
        return Err(ConnectError::invalid(format!(
            "unexpected envelope flags {flags:#04x} in a request"
        )));
    }
    let v = decode(m.request, payload).map_err(bad)?;
    Ok(envelope(
        0,
        &serde_json::to_vec(&v).expect("JSON value serializes"),
    ))
}

/// Splits a byte stream into envelopes (flags, payload) as bytes arrive.
#[derive(Default)]
struct Splitter {
    buf: Vec<u8>,
}

impl Splitter {
    fn next(&mut self) -> Result<Option<(u8, Vec<u8>)>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE_BYTES {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("message of {len} bytes is over the limit of {MAX_MESSAGE_BYTES}"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let flags = self.buf[0];
        let payload = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Ok(Some((flags, payload)))
    }
}

/// An envelope the JSON handlers reject with `err`'s message: used when a client stream's
/// later message is malformed (the handler answers the stream with `invalid_argument`).
fn poison(err: &ConnectError) -> Bytes {
    envelope(
        0,
        &serde_json::to_vec(&Value::from(format!(
            "{}{}",
            super::connect::TRANSCODE_ERROR,
            err.message
        )))
        .expect("serializes"),
    )
}

/// The Connect routes' binary-codec layer (module docs). Calls in the JSON codec, and
/// paths that are not a served method, pass through untouched.
pub async fn codec(req: Request, next: Next) -> Response {
    let Some(wire) = proto_wire(&req) else {
        return next.run(req).await;
    };
    let Some(m) = method(req.uri().path()) else {
        return next.run(req).await; // the handler answers "no method"
    };
    let stream_fail = |e: ConnectError| super::connect::stream_error(e).into_response();
    if (wire == Wire::Stream) != m.streaming {
        let e = ConnectError::invalid(if m.streaming {
            "this method is a streaming call: send Content-Type application/connect+proto"
        } else {
            "this method is a unary call: send Content-Type application/proto"
        });
        return if wire == Wire::Stream {
            stream_fail(e)
        } else {
            e.into_response()
        };
    }
    let (mut parts, body) = req.into_parts();
    let json_ct = if m.streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    parts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(json_ct));
    parts.headers.remove(header::CONTENT_LENGTH);
    let client_stream = parts.uri.path() == "/process.Process/StreamInput";
    let new_body = if client_stream {
        // Transcode the envelopes as they arrive.
        let mut split = Splitter::default();
        let stream = body.into_data_stream().flat_map(move |chunk| {
            let mut out: Vec<Result<Bytes, std::io::Error>> = Vec::new();
            match chunk {
                Ok(c) => {
                    split.buf.extend_from_slice(&c);
                    loop {
                        match split.next() {
                            Ok(Some((flags, p))) => match envelope_to_json(&m, flags, &p) {
                                Ok(b) => out.push(Ok(b)),
                                Err(e) => {
                                    out.push(Ok(poison(&e)));
                                    split.buf.clear();
                                    break;
                                }
                            },
                            Ok(None) => break,
                            Err(e) => {
                                out.push(Ok(poison(&e)));
                                split.buf.clear();
                                break;
                            }
                        }
                    }
                }
                Err(e) => out.push(Err(std::io::Error::other(e.to_string()))),
            }
            futures::stream::iter(out)
        });
        Body::from_stream(stream)
    } else {
        let raw = match axum::body::to_bytes(body, MAX_MESSAGE_BYTES + 5).await {
            Ok(b) => b,
            Err(e) => {
                let e = ConnectError::new("resource_exhausted", format!("request body: {e}"));
                return if m.streaming {
                    stream_fail(e)
                } else {
                    e.into_response()
                };
            }
        };
        let json = if m.streaming {
            let mut split = Splitter::default();
            split.buf.extend_from_slice(&raw);
            let one = match split.next() {
                Ok(Some((flags, p))) if split.buf.is_empty() => envelope_to_json(&m, flags, &p),
                Ok(_) => Err(ConnectError::invalid(format!(
                    "request body of {} bytes is not one Connect envelope",
                    raw.len()
                ))),
                Err(e) => Err(e),
            };
            match one {
                Ok(b) => b,
                Err(e) => return stream_fail(e),
            }
        } else {
            match decode(m.request, &raw) {
                Ok(v) => Bytes::from(serde_json::to_vec(&v).expect("JSON value serializes")),
                Err(e) => return bad(e).into_response(),
            }
        };
        Body::from(json)
    };
    let resp = next.run(Request::from_parts(parts, new_body)).await;
    if m.streaming {
        stream_to_proto(&m, resp)
    } else {
        unary_to_proto(&m, resp).await
    }
}

async fn unary_to_proto(m: &Method, resp: Response) -> Response {
    if resp.status() != StatusCode::OK {
        return resp; // Connect unary errors are JSON in every codec
    }
    let (mut parts, body) = resp.into_parts();
    let raw = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => return ConnectError::new("internal", e.to_string()).into_response(),
    };
    let encoded = serde_json::from_slice::<Value>(&raw)
        .map_err(|e| e.to_string())
        .and_then(|v| encode(m.response, &v));
    match encoded {
        Ok(b) => {
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/proto"),
            );
            parts.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(parts, Body::from(b))
        }
        Err(e) => {
            tracing::error!(error = %e, "e2b: a response does not fit its protobuf message");
            ConnectError::new("internal", format!("encoding the response: {e}")).into_response()
        }
    }
}

fn stream_to_proto(m: &Method, resp: Response) -> Response {
    let (mut parts, body) = resp.into_parts();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+proto"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    let schema = m.response;
    let mut split = Splitter::default();
    let mut done = false;
    let stream = body.into_data_stream().flat_map(move |chunk| {
        let mut out: Vec<Result<Bytes, axum::Error>> = Vec::new();
        if done {
            return futures::stream::iter(out);
        }
        match chunk {
            Ok(c) => {
                split.buf.extend_from_slice(&c);
                while let Ok(Some((flags, payload))) = split.next() {
                    if flags & END_STREAM != 0 {
                        out.push(Ok(envelope(flags, &payload)));
                        continue;
                    }
                    let enc = serde_json::from_slice::<Value>(&payload)
                        .map_err(|e| e.to_string())
                        .and_then(|v| encode(schema, &v));
                    match enc {
                        Ok(b) => out.push(Ok(envelope(0, &b))),
                        Err(e) => {
                            tracing::error!(error = %e, "e2b: a stream message does not fit its protobuf message");
                            let err = ConnectError::new("internal", format!("encoding a message: {e}"));
                            out.push(Ok(super::connect::end_stream(Some(&err))));
                            done = true;
                            break;
                        }
                    }
                }
            }
            Err(e) => out.push(Err(e)),
        }
        futures::stream::iter(out)
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_round_trip_through_binary() {
        let start = json!({
            "process": {"cmd": "/bin/sh", "args": ["-c", "echo hi"], "envs": {"A": "1"}, "cwd": "/tmp"},
            "pty": {"size": {"cols": 80, "rows": 24}},
            "tag": "t",
            "stdin": false,
        });
        let raw = encode(&START_REQUEST, &start).unwrap();
        assert_eq!(decode(&START_REQUEST, &raw).unwrap(), start);
        let sig = json!({"process": {"pid": 1000}, "signal": "SIGNAL_SIGKILL"});
        let raw = encode(&SEND_SIGNAL_REQUEST, &sig).unwrap();
        assert_eq!(decode(&SEND_SIGNAL_REQUEST, &raw).unwrap(), sig);
        let inp = json!({"data": {"input": {"stdin": "aGk="}}});
        let raw = encode(&STREAM_INPUT_REQUEST, &inp).unwrap();
        assert_eq!(decode(&STREAM_INPUT_REQUEST, &raw).unwrap(), inp);
    }

    #[test]
    fn responses_encode_with_envds_field_numbers() {
        // StartResponse{event{end{exit_code=-1 (sint32 zigzag 1), exited=false}}}
        let v = json!({"event": {"end": {"exitCode": -1, "exited": false, "status": "s"}}});
        let raw = encode(&START_RESPONSE, &v).unwrap();
        assert_eq!(
            raw,
            [0x0a, 9, 0x1a, 7, 0x08, 0x01, 0x10, 0x00, 0x1a, 1, b's']
        );
        assert_eq!(decode(&START_RESPONSE, &raw).unwrap(), v);
        let e = json!({"entry": {"name": "a", "type": "FILE_TYPE_DIRECTORY", "path": "/a",
            "size": "4096", "mode": 493, "permissions": "drwxr-xr-x", "owner": "root",
            "group": "root", "modifiedTime": "2026-01-02T03:04:05.678Z"}});
        let raw = encode(&ENTRY_RESPONSE, &e).unwrap();
        assert_eq!(decode(&ENTRY_RESPONSE, &raw).unwrap(), e);
        // keepalive {} is an empty but present message.
        assert_eq!(
            encode(&START_RESPONSE, &json!({"event": {"keepalive": {}}})).unwrap(),
            [0x0a, 2, 0x22, 0]
        );
    }

    #[test]
    fn malformed_binary_is_refused_and_unknown_fields_skipped() {
        assert!(decode(&START_REQUEST, &[0x0a, 50, 1]).is_err()); // truncated
        assert!(decode(&START_REQUEST, &[0xff; 11]).is_err()); // bad varint
        assert!(decode(&START_REQUEST, &[0x08, 1]).is_err()); // wire type 0 for a message
        assert!(decode(&START_REQUEST, &[0x0b]).is_err()); // group
        assert!(decode(&START_REQUEST, &[0x00, 0]).is_err()); // field 0
        assert!(decode(&PATH_REQUEST, &[0x0a, 1, 0xff]).is_err()); // not UTF-8
        assert_eq!(
            decode(&PATH_REQUEST, &[0x78, 5, 0x0a, 1, b'x']).unwrap(),
            json!({"path": "x"})
        );
        assert!(method("/process.Process/Nope").is_none());
    }
}
