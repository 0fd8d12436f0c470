//! [`nbd::Exports`] over a cluster: every volume, by name.

use std::sync::Arc;

use volume::driver::client::{Cluster, Volume};
use volume::driver::meta::{MetaReq, MetaResp};

/// Exports every volume of a cluster under its name. Each NBD connection that selects a name
/// opens the volume afresh through the metadata service, so it sees the volume's current size
/// and layout; a volume removed by `collapse` or `delete` is no longer offered.
pub struct ClusterExports {
    cluster: Arc<Cluster>,
}

impl ClusterExports {
    pub fn new(cluster: Arc<Cluster>) -> Self {
        ClusterExports { cluster }
    }
}

impl nbd::Exports for ClusterExports {
    type Dev = Volume;

    async fn open(&self, name: &str) -> Result<Arc<Volume>, String> {
        if name.is_empty() {
            let names = self.list().await;
            return Err(format!("name a volume in the URI (nbd://HOST:PORT/VOLUME); volumes: {names:?}"));
        }
        match self.cluster.open(name).await {
            Ok(v) => {
                tracing::info!(volume = name, id = v.record().vol.id, "NBD export opened");
                Ok(Arc::new(v))
            }
            Err(e) => Err(format!("{e:#}")),
        }
    }

    async fn list(&self) -> Vec<String> {
        match self.cluster.meta(MetaReq::List).await {
            Ok(MetaResp::Volumes(v)) => v.into_iter().map(|r| r.name).collect(),
            Ok(other) => {
                tracing::warn!("metadata service answered {other:?} to List");
                vec![]
            }
            Err(e) => {
                tracing::warn!("cannot list volumes: {e:#}");
                vec![]
            }
        }
    }
}
