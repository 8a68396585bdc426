// SPDX-License-Identifier: GPL-2.0
/*
 * Device memory in the dmem cgroup controller: the C side of gmem/obj/dmem.rs.
 *
 * Each registered device is one dmem region ("gmem/gmemN", its size the device's frames),
 * and every frame gmem hands out is one page-sized charge to the dmem cgroup of the
 * process that owns the space the frame holds a page of: mm->owner, looked up at the time
 * of the charge, whichever task does the allocation (a device fault raised by a driver's
 * thread, the prefetch worker, an eviction parking a page on a peer). When that process
 * has exited (mm->owner is NULL) the task doing the work is charged. The kernel patch
 * scripts/kernel-patches/0001-cgroup-dmem-charge-on-behalf-of-a-task.patch adds
 * dmem_cgroup_try_charge_task() for this; 0002-cgroup-dmem-charge-and-uncharge-in-batches.patch
 * adds dmem_cgroup_try_charge_task_many() and dmem_cgroup_uncharge_many(), so that a batch's
 * frames are charged in one call (a 2 MiB block's 512 charges took 104-338 us of a worker's
 * time under TCG, median about 170 us) and the frames a batch frees are uncharged together.
 *
 * Setting a cgroup's dmem.max below its use calls gmem_dmem_reclaim(), which asks the core
 * to evict that cgroup's frames (gmem_dmem_reclaim_frames() in obj/dmem.rs).
 */
#include <linux/cgroup_dmem.h>
#include <linux/mm.h>
#include <linux/mm_types.h>
#include <linux/rcupdate.h>
#include <linux/sched.h>
#include <linux/sched/task.h>

/* In obj/dmem.rs: evicts up to @frames frames of device @id charged within @pool. */
int gmem_dmem_reclaim_frames(unsigned long id, struct dmem_cgroup_pool_state *pool, u64 frames);

static int gmem_dmem_reclaim(struct dmem_cgroup_pool_state *pool, u64 target_bytes, void *priv)
{
	return gmem_dmem_reclaim_frames((unsigned long)priv, pool, DIV_ROUND_UP(target_bytes, PAGE_SIZE));
}

static const struct dmem_cgroup_ops gmem_dmem_ops = {
	.reclaim = gmem_dmem_reclaim,
};

/*
 * The region of device @id with @frames frames; NULL when the kernel has no dmem
 * controller, an ERR_PTR on failure. The reclaim callback names the device by id:
 * gmem_dmem_unregister() runs before the id can be reused and waits for every callback.
 */
struct dmem_cgroup_region *gmem_dmem_register(unsigned long id, u64 frames);
struct dmem_cgroup_region *gmem_dmem_register(unsigned long id, u64 frames)
{
	struct dmem_cgroup_init init = {
		.size = frames * PAGE_SIZE,
		.ops = &gmem_dmem_ops,
		.reclaim_priv = (void *)id,
	};

	return dmem_cgroup_register_region(&init, "gmem/gmem%lu", id);
}

void gmem_dmem_unregister(struct dmem_cgroup_region *region);
void gmem_dmem_unregister(struct dmem_cgroup_region *region)
{
	dmem_cgroup_unregister_region(region);
}

/*
 * Charges up to @n pages of @region to the dmem cgroup of @mm's owner, one charge per page,
 * storing each charged pool in @pools. Returns how many were charged; when a limit stopped
 * it, *@limit holds a reference to the pool at its limit (put with gmem_dmem_pool_put());
 * when an error did (no memory for the cgroup's pool state), *@err holds it (else 0).
 * All @n are charged in one call when they fit; when they do not, page by page up to the
 * limit (the batch's own limit reference is put first). Either way each page holds one
 * reference, given back by gmem_dmem_uncharge() or gmem_dmem_uncharge_many().
 * @mm must be kept alive by the caller (mmgrab). May sleep.
 */
u32 gmem_dmem_charge(struct dmem_cgroup_region *region, struct mm_struct *mm, u32 n,
		     struct dmem_cgroup_pool_state **pools, struct dmem_cgroup_pool_state **limit, int *err);
u32 gmem_dmem_charge(struct dmem_cgroup_region *region, struct mm_struct *mm, u32 n,
		     struct dmem_cgroup_pool_state **pools, struct dmem_cgroup_pool_state **limit, int *err)
{
	struct task_struct *owner = NULL;
	u32 k;
	int ret;

	*limit = NULL;
	*err = 0;
#ifdef CONFIG_MEMCG
	rcu_read_lock();
	owner = rcu_dereference(mm->owner);
	if (owner)
		get_task_struct(owner);
	rcu_read_unlock();
#endif
	k = 0;
	if (n > 1) {
		struct dmem_cgroup_pool_state *pool, *full = NULL;

		if (!dmem_cgroup_try_charge_task_many(region, owner ?: current, PAGE_SIZE, n, &pool, &full)) {
			for (; k < n; k++)
				pools[k] = pool;
		} else {
			dmem_cgroup_pool_state_put(full);
		}
	}
	for (; k < n; k++) {
		ret = dmem_cgroup_try_charge_task(region, owner ?: current, PAGE_SIZE, &pools[k], limit);
		if (ret) {
			/* -EAGAIN: a limit (*@limit says which, if any cgroup's). */
			if (ret != -EAGAIN)
				*err = ret;
			break;
		}
	}
	if (owner)
		put_task_struct(owner);
	return k;
}

void gmem_dmem_uncharge(struct dmem_cgroup_pool_state *pool);
void gmem_dmem_uncharge(struct dmem_cgroup_pool_state *pool)
{
	dmem_cgroup_uncharge(pool, PAGE_SIZE);
}

/* @n page charges of @pool given back at once (as @n calls of gmem_dmem_uncharge()). */
void gmem_dmem_uncharge_many(struct dmem_cgroup_pool_state *pool, u32 n);
void gmem_dmem_uncharge_many(struct dmem_cgroup_pool_state *pool, u32 n)
{
	dmem_cgroup_uncharge_many(pool, PAGE_SIZE, n);
}

/*
 * Whether a frame charged to @pool may be evicted to make room in @limit (@pool is @limit
 * or below it, and not protected by dmem.min / dmem.low; @ignore_low drops the latter).
 * With @limit NULL (the device itself is full): whether @pool's protection against the
 * root allows it.
 */
bool gmem_dmem_evictable(struct dmem_cgroup_pool_state *limit, struct dmem_cgroup_pool_state *pool,
			 bool ignore_low);
bool gmem_dmem_evictable(struct dmem_cgroup_pool_state *limit, struct dmem_cgroup_pool_state *pool,
			 bool ignore_low)
{
	bool hit_low = false;

	return pool && dmem_cgroup_state_evict_valuable(limit, pool, ignore_low, &hit_low);
}

void gmem_dmem_pool_put(struct dmem_cgroup_pool_state *pool);
void gmem_dmem_pool_put(struct dmem_cgroup_pool_state *pool)
{
	dmem_cgroup_pool_state_put(pool);
}
