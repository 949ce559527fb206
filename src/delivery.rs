//! Delivering one job as an HTTP request.
//!
//! One `reqwest::Client` (one connection pool) serves every delivery. Redirects are never
//! followed (a 3xx is the downstream's answer, and following it would let a job reach a
//! URL outside its destination's allow-list). At most [`SNIPPET_BYTES`] of a response
//! body are read: a huge or endless body cannot stall the dispatcher or exhaust memory.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, USER_AGENT};
use reqwest::redirect::Policy;
use reqwest::Method;

use crate::store::ClaimedJob;

/// How much of a response body is kept on the job.
pub const SNIPPET_BYTES: usize = 2_048;

/// `User-Agent` sent with every request.
pub const USER_AGENT_VALUE: &str = concat!("sluice/", env!("CARGO_PKG_VERSION"));

/// A response, as far as Sluice reads it.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Response headers (Retry-After and rate-limit headers live here).
    pub headers: HeaderMap,
    /// The first [`SNIPPET_BYTES`] of the body, lossily decoded.
    pub snippet: Option<String>,
}

/// A request built ahead of its release.
#[derive(Debug)]
pub struct Prepared {
    request: reqwest::Request,
    timeout_ms: u64,
}

/// Why no response arrived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeliveryError {
    /// The destination's timeout elapsed.
    #[error("timed out after {0} ms")]
    Timeout(u64),
    /// The connection could not be established (refused, DNS, TLS).
    #[error("connection failed: {0}")]
    Connect(String),
    /// The connection broke mid-request.
    #[error("request failed: {0}")]
    Transport(String),
    /// The stored request cannot be sent (bad method or header); retrying cannot help.
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl DeliveryError {
    /// Whether another attempt might succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, DeliveryError::Invalid(_))
    }
}

/// Sends jobs over a shared connection pool.
#[derive(Debug, Clone)]
pub struct Deliverer {
    client: reqwest::Client,
}

impl Deliverer {
    /// Builds the shared client.
    pub fn new() -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .redirect(Policy::none())
            .user_agent(USER_AGENT_VALUE)
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .build()?;
        Ok(Self { client })
    }

    /// Builds the request for `job` ahead of its slot, so that releasing it costs only
    /// the send.
    pub fn prepare(&self, job: &ClaimedJob) -> Result<Prepared, DeliveryError> {
        let timeout_ms = u64::try_from(job.timeout_ms).unwrap_or(10_000);
        let method = Method::from_bytes(job.method.as_bytes())
            .map_err(|_| DeliveryError::Invalid(format!("method {:?}", job.method)))?;
        let mut headers = HeaderMap::with_capacity(job.headers.len() + 2);
        for (name, value) in &job.headers {
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| DeliveryError::Invalid(format!("header name {name:?}")))?;
            let v = HeaderValue::from_str(value)
                .map_err(|_| DeliveryError::Invalid(format!("header value of {name:?}")))?;
            headers.append(n, v);
        }
        let idempotency = HeaderName::from_static("idempotency-key");
        if !headers.contains_key(&idempotency) {
            headers.insert(
                idempotency,
                HeaderValue::from_str(&job.id.to_string())
                    .map_err(|e| DeliveryError::Invalid(e.to_string()))?,
            );
        }
        headers.insert(USER_AGENT, HeaderValue::from_static(USER_AGENT_VALUE));
        let mut req = self
            .client
            .request(method, job.url.as_str())
            .headers(headers)
            .timeout(Duration::from_millis(timeout_ms));
        if let Some(body) = &job.body {
            req = req.body(body.clone());
        }
        let request = req
            .build()
            .map_err(|e| DeliveryError::Invalid(error_chain(&e)))?;
        Ok(Prepared {
            request,
            timeout_ms,
        })
    }

    /// Sends `job` and reads at most a snippet of the response.
    pub async fn send(&self, job: &ClaimedJob) -> Result<Response, DeliveryError> {
        let prepared = self.prepare(job)?;
        self.execute(prepared).await
    }

    /// Sends a prepared request and reads at most a snippet of the response.
    pub async fn execute(&self, prepared: Prepared) -> Result<Response, DeliveryError> {
        let Prepared {
            request,
            timeout_ms,
        } = prepared;
        let classify = |e: reqwest::Error| {
            if e.is_timeout() {
                DeliveryError::Timeout(timeout_ms)
            } else if e.is_connect() {
                DeliveryError::Connect(error_chain(&e))
            } else if e.is_builder() {
                DeliveryError::Invalid(error_chain(&e))
            } else {
                DeliveryError::Transport(error_chain(&e))
            }
        };
        let mut resp = self.client.execute(request).await.map_err(classify)?;
        let status = resp.status().as_u16();
        let headers = std::mem::take(resp.headers_mut());
        // Read a bounded prefix; a body that breaks off or times out mid-way still counts
        // as the response we got (the status is what matters).
        let mut buf: Vec<u8> = Vec::new();
        while buf.len() < SNIPPET_BYTES {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    let room = SNIPPET_BYTES - buf.len();
                    buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
                Ok(None) | Err(_) => break,
            }
        }
        let snippet = (!buf.is_empty()).then(|| String::from_utf8_lossy(&buf).into_owned());
        Ok(Response {
            status,
            headers,
            snippet,
        })
    }
}

/// The error and its sources on one line ("connection refused" hides at the bottom).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let msg = src.to_string();
        if !s.contains(&msg) {
            s.push_str(": ");
            s.push_str(&msg);
        }
        cur = src.source();
    }
    s
}
