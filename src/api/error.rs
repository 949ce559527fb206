//! API errors: every failure becomes a status code and a JSON body
//! `{"error": {"code": "...", "message": "...", "field": "..."}}`.
//!
//! Policy: client mistakes are explained in full; infrastructure failures are logged and
//! answered with a generic message (503 while the database is unreachable, 500 otherwise),
//! never echoing internals.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::destination::FieldError;
use crate::store::{self, EnqueueError};

/// An error answered to an API client.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    field: Option<String>,
    retry_after_secs: Option<u64>,
}

impl ApiError {
    /// An error with a status, a stable machine-readable code and a human message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after_secs: None,
        }
    }

    /// 422 for a field that failed validation.
    pub fn field(code: &'static str, e: FieldError) -> Self {
        Self {
            field: Some(e.field.clone()),
            ..Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, e.to_string())
        }
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"code": self.code, "message": self.message});
        if let Some(f) = self.field {
            body["field"] = json!(f);
        }
        let mut resp = (self.status, Json(json!({ "error": body }))).into_response();
        if let Some(secs) = self.retry_after_secs {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl From<store::Error> for ApiError {
    fn from(e: store::Error) -> Self {
        match e {
            store::Error::UnknownDestination(_) => Self::new(
                StatusCode::NOT_FOUND,
                "destination_not_found",
                e.to_string(),
            ),
            store::Error::UnknownJob(_) => {
                Self::new(StatusCode::NOT_FOUND, "job_not_found", e.to_string())
            }
            store::Error::WrongState { .. } => {
                Self::new(StatusCode::CONFLICT, "job_state_conflict", e.to_string())
            }
            store::Error::InvalidJob(f) => Self::field("invalid_job", f),
            e if e.is_unavailable() => {
                tracing::warn!(error = %e, "database unavailable");
                let mut err = Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database_unavailable",
                    "the database is unavailable; retry shortly",
                );
                err.retry_after_secs = Some(1);
                err
            }
            e => {
                tracing::error!(error = %e, "internal error");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; see the server log",
                )
            }
        }
    }
}

impl From<EnqueueError> for ApiError {
    fn from(e: EnqueueError) -> Self {
        match e {
            EnqueueError::Full {
                retry_after_secs, ..
            } => {
                let mut err = Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "destination_full",
                    e.to_string(),
                );
                err.retry_after_secs = Some(retry_after_secs);
                err
            }
            EnqueueError::Store(e) => e.into(),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let code = match &r {
            JsonRejection::JsonDataError(_) => "invalid_field",
            JsonRejection::JsonSyntaxError(_) => "malformed_json",
            JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
            _ if r.status() == StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
            _ => "bad_request",
        };
        Self::new(r.status(), code, r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_path", r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_query", r.body_text())
    }
}
