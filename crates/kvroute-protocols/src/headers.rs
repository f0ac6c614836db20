//! Routing overrides carried in HTTP headers, applied onto an [`NvExt`].
//!
//! Headers are taken as `(name, value)` pairs so this crate needs no HTTP library. Names match
//! case-insensitively (HTTP header names are case-insensitive); a repeated header's last value
//! wins. Unlike the reference, which silently drops a value it cannot parse, a malformed value is
//! an error: a caller that pins a worker and has the pin ignored would never find out.

use crate::{DpRank, NvExt, ProtocolError, WorkerId};

/// Sets `backend_instance_id` and `decode_worker_id`.
pub const HEADER_WORKER_INSTANCE_ID: &str = "x-worker-instance-id";
/// Sets `prefill_worker_id`.
pub const HEADER_PREFILL_INSTANCE_ID: &str = "x-prefill-instance-id";
/// Sets `dp_rank`.
pub const HEADER_DP_RANK: &str = "x-dp-rank";
/// Sets `prefill_dp_rank`.
pub const HEADER_PREFILL_DP_RANK: &str = "x-prefill-dp-rank";
/// A dp-rank header with this value means "unset": it overrides nothing.
pub const UNSET_DP_RANK: DpRank = DpRank::MAX;

/// The routing overrides found in a request's headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeaderOverrides {
    /// From `x-worker-instance-id`.
    pub worker_instance_id: Option<WorkerId>,
    /// From `x-prefill-instance-id`.
    pub prefill_instance_id: Option<WorkerId>,
    /// From `x-dp-rank` (`u32::MAX` reads as `None`).
    pub dp_rank: Option<DpRank>,
    /// From `x-prefill-dp-rank` (`u32::MAX` reads as `None`).
    pub prefill_dp_rank: Option<DpRank>,
}

impl HeaderOverrides {
    /// Reads the routing headers among `headers`, ignoring every other header.
    pub fn from_headers<'a, I>(headers: I) -> Result<Self, ProtocolError>
    where
        I: IntoIterator<Item = (&'a str, &'a [u8])>,
    {
        let mut out = HeaderOverrides::default();
        for (name, value) in headers {
            if name.eq_ignore_ascii_case(HEADER_WORKER_INSTANCE_ID) {
                out.worker_instance_id = Some(parse(HEADER_WORKER_INSTANCE_ID, value)?);
            } else if name.eq_ignore_ascii_case(HEADER_PREFILL_INSTANCE_ID) {
                out.prefill_instance_id = Some(parse(HEADER_PREFILL_INSTANCE_ID, value)?);
            } else if name.eq_ignore_ascii_case(HEADER_DP_RANK) {
                out.dp_rank = rank(parse(HEADER_DP_RANK, value)?);
            } else if name.eq_ignore_ascii_case(HEADER_PREFILL_DP_RANK) {
                out.prefill_dp_rank = rank(parse(HEADER_PREFILL_DP_RANK, value)?);
            }
        }
        Ok(out)
    }

    /// Whether no header overrides anything.
    pub fn is_empty(&self) -> bool {
        *self == HeaderOverrides::default()
    }

    /// Applies the overrides onto `nvext` (headers win over body values). Returns `nvext`
    /// untouched when there is nothing to apply, so a request without nvext stays without.
    pub fn apply(&self, nvext: Option<NvExt>) -> Option<NvExt> {
        if self.is_empty() {
            return nvext;
        }
        let mut ext = nvext.unwrap_or_default();
        if let Some(id) = self.worker_instance_id {
            ext.backend_instance_id = Some(id);
            ext.decode_worker_id = Some(id);
        }
        if let Some(id) = self.prefill_instance_id {
            ext.prefill_worker_id = Some(id);
        }
        if let Some(r) = self.dp_rank {
            ext.dp_rank = Some(r);
        }
        if let Some(r) = self.prefill_dp_rank {
            ext.prefill_dp_rank = Some(r);
        }
        Some(ext)
    }
}

/// Reads the routing headers and applies them onto `nvext`; see [`HeaderOverrides`].
pub fn apply_header_routing_overrides<'a, I>(
    nvext: Option<NvExt>,
    headers: I,
) -> Result<Option<NvExt>, ProtocolError>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    Ok(HeaderOverrides::from_headers(headers)?.apply(nvext))
}

fn rank(r: DpRank) -> Option<DpRank> {
    (r != UNSET_DP_RANK).then_some(r)
}

trait HeaderInt: std::str::FromStr {
    const EXPECTED: &'static str;
}

impl HeaderInt for u64 {
    const EXPECTED: &'static str = "an unsigned 64-bit integer";
}

impl HeaderInt for u32 {
    const EXPECTED: &'static str = "an unsigned 32-bit integer";
}

fn parse<T: HeaderInt>(name: &'static str, value: &[u8]) -> Result<T, ProtocolError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<T>().ok())
        .ok_or_else(|| ProtocolError::Header {
            name,
            value: String::from_utf8_lossy(value).into_owned(),
            expected: T::EXPECTED,
        })
}
