//! How a step's prompt-token budget is shared among the prompts being computed. First come,
//! first served alone let one tenant's long prompt hold every later prompt — another
//! tenant's five-token question included — for its whole length (a 3000-token prompt held a
//! short one for a minute on a slow machine). Each tenant with a prompt to compute now gets
//! an equal share of the budget, spent first come, first served among its own prompts; what
//! the shares leave goes first come, first served to all. One tenant's prompts keep their
//! order, so its own earliest prompt is never slowed by its later ones.

/// Prompt tokens each prefilling request computes this step, from `budget`. `prefilling`
/// holds each one's tenant and prompt tokens still to compute, in arrival order; the result
/// is in the same order, each at most its remaining tokens, their sum at most `budget`.
pub(super) fn prefill_shares(prefilling: &[(&str, usize)], budget: usize) -> Vec<usize> {
    let mut out = vec![0; prefilling.len()];
    let mut tenants: Vec<&str> = Vec::new();
    for (tenant, _) in prefilling {
        if !tenants.contains(tenant) {
            tenants.push(tenant);
        }
    }
    if tenants.is_empty() {
        return out;
    }
    let mut left = budget;
    let share = (budget / tenants.len()).max(1);
    for tenant in tenants {
        let mut quota = share.min(left);
        for (k, (owner, remaining)) in prefilling.iter().enumerate() {
            if quota == 0 {
                break;
            }
            if *owner == tenant {
                let n = (remaining - out[k]).min(quota);
                out[k] += n;
                quota -= n;
                left -= n;
            }
        }
    }
    for (k, (_, remaining)) in prefilling.iter().enumerate() {
        let n = (remaining - out[k]).min(left);
        out[k] += n;
        left -= n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::prefill_shares;

    #[test]
    fn one_tenants_prompts_go_first_come_first_served() {
        assert_eq!(prefill_shares(&[("a", 40), ("a", 40)], 16), [16, 0]);
        assert_eq!(prefill_shares(&[("a", 10), ("a", 40)], 16), [10, 6]);
        assert_eq!(prefill_shares(&[], 16), Vec::<usize>::new());
    }

    #[test]
    fn tenants_share_the_budget_and_what_a_share_leaves_goes_first_come() {
        // A long prompt first, another tenant's short one after: both move at once.
        assert_eq!(prefill_shares(&[("a", 3000), ("b", 5)], 512), [507, 5]);
        assert_eq!(prefill_shares(&[("a", 3000), ("b", 3000)], 512), [256, 256]);
        // Three tenants, a's two prompts in its order within its share.
        assert_eq!(
            prefill_shares(&[("a", 100), ("b", 100), ("a", 100), ("c", 1)], 90),
            [59, 30, 0, 1]
        );
        // More tenants than tokens: one each, first come, while the budget lasts.
        assert_eq!(
            prefill_shares(&[("a", 9), ("b", 9), ("c", 9)], 2),
            [1, 1, 0]
        );
    }
}
