//! Admission limits beyond the pool: the model's context length and, when
//! tenant salts are mandatory, the set of tenants allowed to use the cache.

use fxhash::FxHashSet;

use super::Request;
use crate::error::{RequestError, Result};
use crate::prompt::TenantSalt;

/// Checks a request must pass before it is queued (none by default).
#[derive(Debug, Clone, Default)]
pub(super) struct AdmissionLimits {
    /// Longest prompt the model can attend over (`max_position_embeddings`).
    pub(super) max_context: Option<usize>,
    /// When set, only these tenants are admitted: a request carrying an
    /// unknown salt is rejected instead of silently getting a cache of its own.
    pub(super) known_tenants: Option<FxHashSet<TenantSalt>>,
}

impl AdmissionLimits {
    pub(super) fn check(&self, req: &Request) -> Result<()> {
        if let Some(max) = self.max_context.filter(|&max| req.prompt.len() > max) {
            return Err(RequestError::ContextTooLong { id: req.id, len: req.prompt.len(), max }.into());
        }
        let tenant = req.prompt.tenant;
        if self.known_tenants.as_ref().is_some_and(|known| !known.contains(&tenant)) {
            return Err(RequestError::UnknownTenant { id: req.id, tenant }.into());
        }
        Ok(())
    }
}
