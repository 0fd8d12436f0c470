//! The volume operations the monitor asks for (super, collapse, drop of a child), through the
//! metadata service.

use std::sync::Arc;

use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp};

use crate::proto::{CollapseOutcome, Input};

/// Super, collapse and drop through the metadata service, each idempotent: a repeated request
/// (after a monitor restart) reports what was already done.
pub struct Volumes {
    pub cluster: Arc<Cluster>,
}

impl Volumes {
    async fn info(&self, name: &str) -> anyhow::Result<Option<volume::driver::meta::VolumeRec>> {
        match self.cluster.meta(MetaReq::Info { name: name.to_string() }).await {
            Ok(MetaResp::Volume(v)) => Ok(Some(v)),
            Ok(other) => anyhow::bail!("unexpected answer {other:?}"),
            Err(e) if e.to_string().contains("no volume") => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn super_(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<Input> = async {
            let Some(p) = self.info(parent).await? else { anyhow::bail!("volume {parent:?} does not exist") };
            match &p.super_child {
                Some(c) if c == child => return Ok(Input::SuperDone { child: child.into() }),
                Some(c) => {
                    return Ok(Input::SuperFailed {
                        child: child.into(),
                        error: format!("{parent} already has super child {c}"),
                        existing_child: Some(c.clone()),
                    })
                }
                None => {}
            }
            self.cluster.meta(MetaReq::Super { parent: parent.into(), child: child.into() }).await?;
            Ok(Input::SuperDone { child: child.into() })
        }
        .await;
        r.unwrap_or_else(|e| Input::SuperFailed { child: child.into(), error: format!("{e:#}"), existing_child: None })
    }

    async fn decided(&self, parent: &str, child: &str) -> anyhow::Result<Option<CollapseOutcome>> {
        let c = self.info(child).await?;
        let p = self.info(parent).await?;
        Ok(match (c, p) {
            (Some(c), _) if c.super_parent.as_deref() == Some(parent) => None,
            (Some(_), None) => Some(CollapseOutcome::Promoted),
            (None, Some(_)) => Some(CollapseOutcome::Rejected),
            (c, p) => anyhow::bail!("cannot tell the state of {child} (exists: {}) and {parent} (exists: {})", c.is_some(), p.is_some()),
        })
    }

    pub async fn collapse(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<CollapseOutcome> = async {
            // Straight to the collapse (it is on the failover's critical path); only when it
            // fails is the outcome looked up: a repeated request (after a restart of the
            // monitor, or a lost answer) finds the child promoted or gone.
            match self.cluster.meta(MetaReq::Collapse { child: child.into() }).await {
                Ok(MetaResp::Collapsed { outcome, .. }) => Ok(match outcome {
                    volume::types::CollapseOutcome::Promoted => CollapseOutcome::Promoted,
                    volume::types::CollapseOutcome::Rejected => CollapseOutcome::Rejected,
                }),
                Ok(other) => anyhow::bail!("unexpected answer {other:?}"),
                Err(e) => match self.decided(parent, child).await? {
                    Some(o) => Ok(o),
                    None => Err(e),
                },
            }
        }
        .await;
        match r {
            Ok(outcome) => Input::CollapseDone { child: child.into(), outcome },
            Err(e) => Input::CollapseFailed { child: child.into(), error: format!("{e:#}") },
        }
    }

    /// Discards a super child and keeps the parent: the metadata service's abort request (the
    /// child is rejected and garbage-collected; the parent keeps permission to write).
    pub async fn drop_child(&self, parent: &str, child: &str) -> Input {
        let r: anyhow::Result<()> = async {
            match self.decided(parent, child).await? {
                Some(CollapseOutcome::Rejected) => return Ok(()),
                Some(CollapseOutcome::Promoted) => anyhow::bail!("{child} was promoted already; it cannot be dropped"),
                None => {}
            }
            match self.cluster.meta(MetaReq::Abort { child: child.into() }).await? {
                MetaResp::Volume(_) => Ok(()),
                other => anyhow::bail!("aborting {child}: unexpected answer {other:?}"),
            }
        }
        .await;
        match r {
            Ok(()) => Input::ChildDropped { child: child.into() },
            Err(e) => Input::DropFailed { child: child.into(), error: format!("{e:#}") },
        }
    }
}
