//! [`TenantSet`]: the tenants of one configuration and their keys, as one value. It is built
//! only by the configuration's parser ([`crate::config::Config::parse`]), so every set holds:
//! at least one tenant; tenant ids unique; every tenant has at least one key; every key hash
//! names exactly one tenant.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::ConfigError;
use crate::keys::{KeyHash, KeyId};
use crate::tenant::{Tenant, TenantId};

/// API key hashes → tenants.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    /// Each hash names one tenant (a key shared by two tenants is refused at parse time).
    by_hash: HashMap<KeyHash, Arc<Tenant>>,
}

impl Keyring {
    /// The tenant whose key hashes to `hash`.
    pub fn tenant(&self, hash: &KeyHash) -> Option<&Arc<Tenant>> {
        self.by_hash.get(hash)
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Every key hash (tests check that no clear key is among them).
    pub fn hashes(&self) -> impl Iterator<Item = &KeyHash> {
        self.by_hash.keys()
    }
}

/// One configured tenant and the public ids of its keys.
#[derive(Debug, Clone)]
pub struct Member {
    pub tenant: Arc<Tenant>,
    /// The ids of its keys ([`KeyHash::id`]), in file order; never the keys or their hashes.
    /// Never empty.
    pub key_ids: Vec<KeyId>,
}

/// The tenants of one configuration, their limits and their keys. See the module doc for the
/// invariants; the only way to get one is a parsed configuration.
#[derive(Debug, Clone)]
pub struct TenantSet {
    /// Every key of every member, and no other.
    keyring: Keyring,
    /// In file order; ids unique; never empty.
    members: Vec<Member>,
}

impl TenantSet {
    /// Key hashes → tenants.
    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    /// The tenants and their key ids, in file order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The tenants, in file order.
    pub fn tenants(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.members.iter().map(|m| &m.tenant)
    }

    /// The tenant with id `id`.
    pub fn get(&self, id: &TenantId) -> Option<&Arc<Tenant>> {
        self.tenants().find(|t| t.id == *id)
    }

    /// The tenants `old` knew under another id: (old id, new id) pairs, where the old id is
    /// one this set lacks and the new id one `old` lacked, holding some of the old id's keys.
    /// Each new id takes the smallest of the old ids whose keys it holds; an old id taken by
    /// several goes to the first of them in file order, and the others start afresh (a split
    /// or merge of tenants is not a rename).
    pub fn renamed_from(&self, old: &TenantSet) -> Vec<(TenantId, TenantId)> {
        fn ids(set: &TenantSet) -> HashSet<&TenantId> {
            set.tenants().map(|t| &t.id).collect()
        }
        let (now, before) = (ids(self), ids(old));
        let mut from: HashMap<&TenantId, &TenantId> = HashMap::new();
        for (hash, tenant) in &self.keyring.by_hash {
            if let Some(was) = old.keyring.tenant(hash)
                && !before.contains(&tenant.id)
                && !now.contains(&was.id)
            {
                // The smallest old id: the same pairs whatever the map's order.
                let entry = from.entry(&tenant.id).or_insert(&was.id);
                *entry = (*entry).min(&was.id);
            }
        }
        let mut taken = HashSet::new();
        self.tenants()
            .filter_map(|t| from.get(&t.id).map(|&was| (was, &t.id)))
            .filter(|(was, _)| taken.insert(*was))
            .map(|(was, new)| (was.clone(), new.clone()))
            .collect()
    }

    /// How many tenants there are (at least one).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always false: a set has at least one tenant.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

/// Builds a [`TenantSet`] tenant by tenant, refusing what would break its invariants. Only the
/// configuration's parser uses it.
#[derive(Debug, Default)]
pub(crate) struct TenantSetBuilder {
    keyring: Keyring,
    members: Vec<Member>,
    ids: HashSet<TenantId>,
}

impl TenantSetBuilder {
    /// Adds `tenant` with the hashes of its keys.
    pub(crate) fn add(&mut self, tenant: Tenant, keys: Vec<KeyHash>) -> Result<(), ConfigError> {
        if !self.ids.insert(tenant.id.clone()) {
            return Err(ConfigError::DuplicateTenant {
                tenant: tenant.id.to_string(),
            });
        }
        if keys.is_empty() {
            return Err(ConfigError::NoKeys {
                tenant: tenant.id.to_string(),
            });
        }
        let tenant = Arc::new(tenant);
        let mut key_ids = Vec::with_capacity(keys.len());
        for hash in keys {
            if let Some(other) = self.keyring.by_hash.insert(hash, tenant.clone()) {
                return Err(if other.id == tenant.id {
                    ConfigError::RepeatedKey {
                        tenant: tenant.id.to_string(),
                    }
                } else {
                    ConfigError::SharedKey {
                        tenant: tenant.id.to_string(),
                        other: other.id.to_string(),
                    }
                });
            }
            key_ids.push(hash.id());
        }
        self.members.push(Member { tenant, key_ids });
        Ok(())
    }

    /// The set; refused when it has no tenant.
    pub(crate) fn build(self) -> Result<TenantSet, ConfigError> {
        if self.members.is_empty() {
            return Err(ConfigError::NoTenants);
        }
        Ok(TenantSet {
            keyring: self.keyring,
            members: self.members,
        })
    }
}
