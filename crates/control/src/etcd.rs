//! The etcd backend: etcd 3.4's v3 JSON gateway on each member's client port, through
//! [`crate::http`]. A request goes to the member that answered last; when that member cannot be
//! reached, the next one is tried, until each has been tried or the operation's deadline passed.
//!
//! Retrying is safe only when the request cannot have been applied: a read is retried on any
//! failure; a write only when its connection failed (nothing was sent) or the member said it has
//! no leader (etcd refuses before proposing). A write that failed after it was sent is reported
//! as [`Error::Uncertain`]: the caller re-reads, as its guarded transaction would have to anyway.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::http::{self, HttpError};
use crate::{Cmp, Compare, Error, KeyValue, LeaseId, Op, Result, Target, TxnOutcome};

/// How long connecting to one member may take before the next is tried (a dead member's port
/// refuses at once; a member behind a cut link does not answer at all).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long one member may take to answer a request. etcd answers within its own request
/// timeout or says it has no leader; a member cut off from quorum may just wait.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one member may take to renew a lease before the next is tried: renewals are small
/// and frequent (a third of the TTL), and a holder that waits on one stuck member for longer
/// could let its TTL pass while another member would have answered.
const KEEPALIVE_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long one operation may try members before it reports them unavailable.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct Etcd {
    endpoints: Vec<String>,
    /// The member tried first: the last one that answered.
    current: AtomicUsize,
}

#[derive(Clone, Copy, PartialEq)]
enum Retry {
    /// Reads and lease renewals: any failure may be retried on another member.
    Always,
    /// Writes: only when nothing was applied.
    IfNotSent,
}

/// An etcd error answer: `{"error": ..., "message": ..., "code": N}`.
#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    message: String,
    #[serde(default)]
    error: String,
    #[serde(default)]
    code: i64,
}

/// gRPC's UNAVAILABLE, which etcd answers when it has no leader (and on its own timeouts).
const CODE_UNAVAILABLE: i64 = 14;

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

/// An int64 field of the gateway's JSON: a string ("12"), a number, or absent (0).
fn int(v: &Value, field: &str) -> i64 {
    match v.get(field) {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn bytes(v: &Value, field: &str) -> std::result::Result<Vec<u8>, String> {
    match v.get(field) {
        Some(Value::String(s)) => B64.decode(s).map_err(|e| format!("field {field} is not base64: {e}")),
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(other) => Err(format!("field {field} is {other}, not base64")),
    }
}

fn key_value(v: &Value) -> std::result::Result<KeyValue, String> {
    let key = String::from_utf8(bytes(v, "key")?).map_err(|_| "a key is not UTF-8".to_string())?;
    Ok(KeyValue {
        key,
        value: bytes(v, "value")?,
        create_revision: int(v, "create_revision"),
        mod_revision: int(v, "mod_revision"),
        version: int(v, "version"),
        lease: int(v, "lease"),
    })
}

fn key_values(v: &Value) -> std::result::Result<Vec<KeyValue>, String> {
    match v.get("kvs") {
        Some(Value::Array(a)) => a.iter().map(key_value).collect(),
        _ => Ok(Vec::new()),
    }
}

/// The end of the range of keys starting with `prefix` (keys are ASCII, so the last byte + 1).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().expect("prefixes are non-empty") += 1;
    end
}

fn compare_json(c: &Compare) -> Value {
    let result = match c.cmp {
        Cmp::Equal => "EQUAL",
        Cmp::NotEqual => "NOT_EQUAL",
        Cmp::Less => "LESS",
        Cmp::Greater => "GREATER",
    };
    let key = b64(c.key.as_bytes());
    match &c.target {
        Target::ModRevision(r) => json!({"key": key, "result": result, "target": "MOD", "mod_revision": r.to_string()}),
        Target::CreateRevision(r) => json!({"key": key, "result": result, "target": "CREATE", "create_revision": r.to_string()}),
        Target::Version(r) => json!({"key": key, "result": result, "target": "VERSION", "version": r.to_string()}),
        Target::Value(v) => json!({"key": key, "result": result, "target": "VALUE", "value": b64(v)}),
    }
}

fn op_json(op: &Op) -> Value {
    match op {
        Op::Put { key, value, lease } => json!({"request_put": {"key": b64(key.as_bytes()), "value": b64(value), "lease": lease.to_string()}}),
        Op::Delete { key } => json!({"request_delete_range": {"key": b64(key.as_bytes())}}),
    }
}

impl Etcd {
    pub(crate) fn new(endpoints: Vec<String>) -> Etcd {
        Etcd { endpoints, current: AtomicUsize::new(0) }
    }

    /// POSTs `body` to `path` on the members in turn until one answers (or `retry` forbids
    /// another try), within `deadline` (default: [`OPERATION_TIMEOUT`] from now).
    async fn call(&self, path: &str, body: &Value, retry: Retry, deadline: Option<Instant>) -> Result<(String, Value)> {
        self.call_with(path, body, retry, deadline, REQUEST_TIMEOUT).await
    }

    /// [`Etcd::call`] with `attempt` as the time one member may take to answer.
    async fn call_with(&self, path: &str, body: &Value, retry: Retry, deadline: Option<Instant>, attempt: Duration) -> Result<(String, Value)> {
        let started = Instant::now();
        let deadline = deadline.unwrap_or(started + OPERATION_TIMEOUT);
        let body = serde_json::to_vec(body).expect("JSON values encode");
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::from("no member tried");
        let mut i = 0usize;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Unavailable { endpoints: self.endpoints.join(","), waited_ms: started.elapsed().as_millis() as u64, last });
            }
            let idx = (first + i) % self.endpoints.len();
            // After one round over every member, pause a little before the next: a member
            // restarting or an election in progress needs some time, not a tight loop.
            if i > 0 && i.is_multiple_of(self.endpoints.len()) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            i += 1;
            let endpoint = &self.endpoints[idx];
            let left = deadline.saturating_duration_since(Instant::now());
            let outcome = http::post(endpoint, path, &body, CONNECT_TIMEOUT.min(left), attempt.min(left).max(Duration::from_millis(1))).await;
            match outcome {
                Ok(resp) if resp.status == 200 => {
                    self.current.store(idx, Ordering::Relaxed);
                    let v: Value = serde_json::from_slice(&resp.body).map_err(|e| Error::Protocol { endpoint: endpoint.clone(), why: format!("{e}: {}", String::from_utf8_lossy(&resp.body)) })?;
                    // A streamed answer (lease keepalive) wraps its message in "result" or "error".
                    if let Some(err) = v.get("error").filter(|e| e.is_object()) {
                        let code = int(err, "code");
                        let message = err.get("message").and_then(Value::as_str).unwrap_or("").to_string();
                        return Err(Error::Etcd { endpoint: endpoint.clone(), code, message });
                    }
                    return Ok((endpoint.clone(), v.get("result").cloned().unwrap_or(v)));
                }
                Ok(resp) => {
                    let err: ErrorBody = serde_json::from_slice(&resp.body).unwrap_or(ErrorBody { message: String::from_utf8_lossy(&resp.body).into_owned(), error: String::new(), code: 0 });
                    let message = if err.message.is_empty() { err.error } else { err.message };
                    let no_leader = message.contains("no leader");
                    if err.code == CODE_UNAVAILABLE && (retry == Retry::Always || no_leader) {
                        last = format!("{endpoint}: {message}");
                        continue;
                    }
                    if err.code == CODE_UNAVAILABLE {
                        return Err(Error::Uncertain { endpoint: endpoint.clone(), why: message });
                    }
                    return Err(Error::Etcd { endpoint: endpoint.clone(), code: err.code, message });
                }
                Err(HttpError::Connect(why)) => last = format!("{endpoint}: {why}"),
                Err(HttpError::AfterSend(why)) => {
                    if retry == Retry::IfNotSent {
                        return Err(Error::Uncertain { endpoint: endpoint.clone(), why });
                    }
                    last = format!("{endpoint}: {why}");
                }
            }
        }
    }

    pub(crate) async fn range(&self, key: &str, prefix: bool, deadline: Option<Instant>) -> Result<Vec<KeyValue>> {
        let mut body = json!({"key": b64(key.as_bytes())});
        if prefix {
            body["range_end"] = json!(b64(&prefix_end(key)));
        }
        let (endpoint, v) = self.call("/v3/kv/range", &body, Retry::Always, deadline).await?;
        key_values(&v).map_err(|why| Error::Protocol { endpoint, why })
    }

    pub(crate) async fn txn(&self, compares: &[Compare], then: &[Op], on_failure_get: Option<&str>) -> Result<TxnOutcome> {
        let failure: Vec<Value> = on_failure_get.map(|k| json!({"request_range": {"key": b64(k.as_bytes())}})).into_iter().collect();
        let body = json!({
            "compare": compares.iter().map(compare_json).collect::<Vec<_>>(),
            "success": then.iter().map(op_json).collect::<Vec<_>>(),
            "failure": failure,
        });
        let (endpoint, v) = match self.call("/v3/kv/txn", &body, Retry::IfNotSent, None).await {
            Err(Error::Etcd { message, .. }) if message.contains("lease not found") => {
                let lease = then.iter().find_map(|op| match op {
                    Op::Put { lease, .. } if *lease != 0 => Some(*lease),
                    _ => None,
                });
                return Err(Error::LeaseExpired(lease.unwrap_or(0)));
            }
            other => other?,
        };
        let succeeded = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
        let revision = v.get("header").map_or(0, |h| int(h, "revision"));
        let mut failure_read = None;
        if !succeeded && on_failure_get.is_some() {
            if let Some(r) = v.get("responses").and_then(|r| r.get(0)).and_then(|r| r.get("response_range")) {
                failure_read = key_values(r).map_err(|why| Error::Protocol { endpoint, why })?.into_iter().next();
            }
        }
        Ok(TxnOutcome { succeeded, revision, failure_read })
    }

    pub(crate) async fn lease_grant(&self, ttl_secs: i64) -> Result<LeaseId> {
        // A grant retried after it was applied leaves an unused lease, which expires alone.
        let (endpoint, v) = self.call("/v3/lease/grant", &json!({"TTL": ttl_secs}), Retry::Always, None).await?;
        match int(&v, "ID") {
            0 => Err(Error::Protocol { endpoint, why: format!("lease grant without an ID: {v}") }),
            id => Ok(id),
        }
    }

    pub(crate) async fn lease_keepalive(&self, id: LeaseId) -> Result<()> {
        let (_, v) = self.call_with("/v3/lease/keepalive", &json!({"ID": id.to_string()}), Retry::Always, None, KEEPALIVE_ATTEMPT_TIMEOUT).await?;
        // etcd answers an expired lease with TTL 0 (absent in the JSON).
        if int(&v, "TTL") <= 0 {
            return Err(Error::LeaseExpired(id));
        }
        Ok(())
    }

    pub(crate) async fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        match self.call("/v3/lease/revoke", &json!({"ID": id.to_string()}), Retry::Always, None).await {
            Err(Error::Etcd { message, .. }) if message.contains("lease not found") => Err(Error::LeaseExpired(id)),
            other => other.map(|_| ()),
        }
    }
}
