// SPDX-License-Identifier: GPL-2.0
/*
 * gmem_csample: a minimal GMEM device driver written in C against <linux/gmem.h> alone.
 *
 * It is deliberately unlike the simulated accelerator, to show that the API does not
 * assume one memory model:
 *  - its memory is one vmalloc'ed area (no struct page per frame), so it offers no
 *    frame_page (the CPU cannot map its memory remotely);
 *  - its page table is an xarray of plain values per context, 4 KiB entries only (no
 *    GMEM_DEV_CAP_MAP_2M), with no accessed bits (no test_clear_accessed);
 *  - it has one copy channel: copies run one at a time under a mutex;
 *  - its capacity is small (mem_kib, 2 MiB by default), so gmem overcommits it.
 * Userspace runs three kernels on it (fill, checksum, gather) through /dev/gmem_csampleN,
 * see include/uapi/linux/gmem_csample.h, and may hot-unplug it.
 *
 * Lifetimes: a struct cs_dev lives from module init to module exit, past its
 * gmem_dev_unregister(), so every callback finds it. Open files pin the module. A kernel
 * runs holding cs_dev.gate shared, together with a reference on the caller's gmem space:
 * its context stays alive (gmem destroys contexts when the space dies or at unregister),
 * and unplug takes the gate exclusively before unregistering, which is what gmem asks
 * ("after the driver stopped calling gmem_dev_fault()").
 *
 * Lock order: gate (rwsem) -> ctx->lock (mutex, leaf). The channel mutex is a leaf, taken
 * only inside the copy callback. gmem is never called with ctx->lock or the channel held.
 */
#include <linux/highmem.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/rwsem.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/vmalloc.h>
#include <linux/xarray.h>

#include "../include/linux/gmem.h"
#include "../include/uapi/linux/gmem_csample.h"

#define CS_MAX_DEVICES	4
#define CS_FAULT_BUFFER	64	/* entries of the device's fault buffer */
#define CS_MAX_GATHER	4096
#define CS_MAX_REPLAYS	16

static unsigned int nr_devices = 2;
module_param(nr_devices, uint, 0444);
MODULE_PARM_DESC(nr_devices, "Number of devices (1..4)");
static unsigned int mem_kib = 2048;
module_param(mem_kib, uint, 0444);
MODULE_PARM_DESC(mem_kib, "Device memory per device, KiB (64..65536, a multiple of 4)");

struct cs_dev {
	int index;
	char name[24];
	u8 *mem;			/* nr_frames * PAGE_SIZE bytes of device memory */
	u64 nr_frames;
	struct mutex channel;		/* the one copy channel */
	struct gmem_dev *gdev;		/* NULL once unregistered */
	int gmem_id;
	struct rw_semaphore gate;	/* kernels: shared; unplug: exclusive */
	bool dead;			/* unplug started: kernels stop, no new ones */
	struct miscdevice misc;
	bool misc_registered;
	atomic64_t ptes;
	atomic64_t copies;
};

/* One context: the device page table of one address space. */
struct cs_ctx {
	struct mutex lock;
	struct xarray pt;		/* va >> PAGE_SHIFT -> entry (xa value) */
};

/*
 * Entries are xarray values: bit 0 writable, bit 1 host page; the rest is the frame
 * number, or the host page's pfn.
 */
#define CS_W	1ul
#define CS_HOST	2ul

static struct cs_dev *cs_devs[CS_MAX_DEVICES];

static void *cs_entry(bool host, unsigned long n, bool w)
{
	return xa_mk_value(n << 2 | (host ? CS_HOST : 0) | (w ? CS_W : 0));
}

static int cs_ctx_create(void *drv, void **ctx)
{
	struct cs_ctx *c = kzalloc(sizeof(*c), GFP_KERNEL);

	if (!c)
		return -ENOMEM;
	mutex_init(&c->lock);
	xa_init(&c->pt);
	*ctx = c;
	return 0;
}

static void cs_ctx_destroy(void *drv, void *ctx)
{
	struct cs_dev *d = drv;
	struct cs_ctx *c = ctx;
	unsigned long idx;
	void *e;
	u64 n = 0;

	xa_for_each(&c->pt, idx, e)
		n++;
	xa_destroy(&c->pt);
	atomic64_sub(n, &d->ptes);
	mutex_destroy(&c->lock);
	kfree(c);
}

static int cs_map(void *drv, void *ctx, const struct gmem_pte *ptes, __u32 n)
{
	struct cs_dev *d = drv;
	struct cs_ctx *c = ctx;
	int err = 0;
	__u32 i;

	mutex_lock(&c->lock);
	for (i = 0; i < n && !err; i++) {
		const struct gmem_pte *p = &ptes[i];
		bool w = p->prot & GMEM_PROT_WRITE;
		void *e, *old;

		/* We declared no capability: a 2 MiB entry (or any flag) is a core bug. */
		if (p->flags) {
			err = -EINVAL;
			break;
		}
		if (p->host)
			e = cs_entry(true, page_to_pfn(p->host), w);
		else if (p->frame < d->nr_frames)
			e = cs_entry(false, p->frame, w);
		else {
			err = -EINVAL;
			break;
		}
		old = xa_store(&c->pt, p->va >> PAGE_SHIFT, e, GFP_KERNEL);
		if (xa_is_err(old))
			err = xa_err(old);
		else if (!old)
			atomic64_inc(&d->ptes);
	}
	mutex_unlock(&c->lock);
	return err;
}

static void cs_unmap(void *drv, void *ctx, __u64 va, __u64 npages)
{
	struct cs_dev *d = drv;
	struct cs_ctx *c = ctx;
	unsigned long first = va >> PAGE_SHIFT, last, idx;
	void *e;

	if (!npages)
		return;
	/* The last page index, clamped at the top of the index space. */
	last = npages - 1 > ULONG_MAX - first ? ULONG_MAX : first + (npages - 1);
	mutex_lock(&c->lock);
	xa_for_each_range(&c->pt, idx, e, first, last) {
		xa_erase(&c->pt, idx);
		atomic64_dec(&d->ptes);
	}
	mutex_unlock(&c->lock);
}

static void cs_tlb_invalidate(void *drv, void *ctx, __u64 va, __u64 npages)
{
	/*
	 * Nothing to do: the device reads its page table under ctx->lock on every access and
	 * caches no translation, so an unmap is visible as soon as cs_unmap returned.
	 */
}

static int cs_copy(void *drv, __u32 dir, const struct gmem_copy *cp, __u32 n, void *peer_drv)
{
	struct cs_dev *d = drv, *peer = peer_drv;
	int err = 0;
	__u32 i;

	mutex_lock(&d->channel);
	for (i = 0; i < n; i++) {
		u8 *frame;

		if (cp[i].frame >= d->nr_frames) {
			err = -EINVAL;
			break;
		}
		frame = d->mem + cp[i].frame * PAGE_SIZE;
		if (dir == GMEM_COPY_H2D && cp[i].host) {
			memcpy_from_page(frame, cp[i].host, 0, PAGE_SIZE);
		} else if (dir == GMEM_COPY_D2H && cp[i].host) {
			memcpy_to_page(cp[i].host, 0, frame, PAGE_SIZE);
		} else if (dir == GMEM_COPY_ZERO) {
			memset(frame, 0, PAGE_SIZE);
		} else if (dir == GMEM_COPY_D2D && peer && cp[i].peer_frame < peer->nr_frames) {
			/* The peer's channel is not taken: the peer frame is gmem's, not in use. */
			memcpy(peer->mem + cp[i].peer_frame * PAGE_SIZE, frame, PAGE_SIZE);
		} else {
			err = -EINVAL;
			break;
		}
	}
	atomic64_add(i, &d->copies);
	mutex_unlock(&d->channel);
	return err;
}

/* frame_page and test_clear_accessed are left out: both are optional. */
static const struct gmem_dev_ops cs_ops = {
	.ctx_create = cs_ctx_create,
	.ctx_destroy = cs_ctx_destroy,
	.map = cs_map,
	.unmap = cs_unmap,
	.tlb_invalidate = cs_tlb_invalidate,
	.copy = cs_copy,
};

/* One running kernel. */
struct cs_run {
	struct cs_dev *d;
	struct gmem_space *space;
	struct cs_ctx *ctx;
	u64 addrs[CS_FAULT_BUFFER];
	unsigned int n;
	u64 faults;
	u64 batches;
};

/* Between chunks: stop if the task is dying or the device is being unplugged. */
static int cs_checkpoint(struct cs_run *r)
{
	if (fatal_signal_pending(current))
		return -EINTR;
	if (READ_ONCE(r->d->dead))
		return -ENODEV;
	cond_resched();
	return 0;
}

/* Reports the fault buffer to gmem as one batch. */
static int cs_flush(struct cs_run *r, bool write)
{
	int err;

	if (!r->n)
		return 0;
	r->faults += r->n;
	r->batches++;
	err = gmem_dev_fault(r->d->gdev, r->space, r->addrs, r->n,
			     write ? GMEM_ACCESS_WRITE : GMEM_ACCESS_READ);
	r->n = 0;
	return err;
}

/* Whether the entry of @va allows the access (ctx->lock held). */
static bool cs_present(struct cs_run *r, u64 va, bool write)
{
	void *e = xa_load(&r->ctx->pt, va >> PAGE_SHIFT);

	return e && (!write || (xa_to_value(e) & CS_W));
}

/* Adds @va to the fault buffer unless mapped; flushes a full buffer. */
static int cs_miss(struct cs_run *r, u64 va, bool write)
{
	bool hit;

	mutex_lock(&r->ctx->lock);
	hit = cs_present(r, va, write);
	mutex_unlock(&r->ctx->lock);
	if (hit)
		return 0;
	r->addrs[r->n++] = va;
	return r->n == CS_FAULT_BUFFER ? cs_flush(r, write) : 0;
}

#define FNV_OFFSET	0xcbf29ce484222325ull
#define FNV_PRIME	0x00000100000001b3ull

/* What a kernel does to the bytes it reaches. */
struct cs_op {
	u32 op;		/* GMEM_CSAMPLE_* */
	u32 value;	/* FILL */
	u64 base;	/* FILL: address of word 0 */
	u64 hash;	/* CHECKSUM */
	u32 word;	/* GATHER */
};

/* Applies @o to the @n bytes (a multiple of 4) at @p, which is device address @va. */
static void cs_apply(struct cs_op *o, u8 *p, u64 va, unsigned int n)
{
	unsigned int k;
	u32 w;

	for (k = 0; k < n; k += 4) {
		switch (o->op) {
		case GMEM_CSAMPLE_FILL:
			w = o->value + (u32)((va + k - o->base) / 4);
			memcpy(p + k, &w, 4);
			break;
		case GMEM_CSAMPLE_CHECKSUM:
			memcpy(&w, p + k, 4);
			o->hash = (o->hash ^ w) * FNV_PRIME;
			break;
		default:
			memcpy(&o->word, p + k, 4);
		}
	}
}

/*
 * Applies @o to [@va, @va + @n) (within one page) under ctx->lock, faulting the page in
 * (and replaying) while it is missing.
 */
static int cs_access(struct cs_run *r, struct cs_op *o, u64 va, unsigned int n)
{
	bool write = o->op == GMEM_CSAMPLE_FILL;
	int tries, err;

	for (tries = 0; tries < CS_MAX_REPLAYS; tries++) {
		void *e;

		mutex_lock(&r->ctx->lock);
		e = xa_load(&r->ctx->pt, va >> PAGE_SHIFT);
		if (e && (!write || (xa_to_value(e) & CS_W))) {
			unsigned long v = xa_to_value(e);
			unsigned int off = va & ~PAGE_MASK;
			u8 *p;

			if (v & CS_HOST)
				p = kmap_local_page(pfn_to_page(v >> 2));
			else
				p = r->d->mem + (v >> 2) * PAGE_SIZE;
			cs_apply(o, p + off, va, n);
			if (v & CS_HOST)
				kunmap_local(p);
			mutex_unlock(&r->ctx->lock);
			return 0;
		}
		mutex_unlock(&r->ctx->lock);
		r->addrs[0] = va;
		r->n = 1;
		err = cs_flush(r, write);
		if (err)
			return err;
	}
	return -EIO;
}

/* FILL and CHECKSUM: stream over [addr, addr + len), CS_FAULT_BUFFER pages at a time. */
static int cs_stream(struct cs_run *r, struct gmem_csample_run *a)
{
	struct cs_op o = { .op = a->op, .value = a->value, .base = a->addr, .hash = FNV_OFFSET };
	bool write = a->op == GMEM_CSAMPLE_FILL;
	u64 off = 0;
	int err;

	while (off < a->len) {
		u64 start = a->addr + off;
		u64 win = min_t(u64, a->len - off, (u64)CS_FAULT_BUFFER * PAGE_SIZE - (start & ~PAGE_MASK));
		u64 va, end = start + win;

		err = cs_checkpoint(r);
		if (err)
			return err;
		/* Fault the window's missing pages in as one batch, then compute on it. */
		for (va = start & PAGE_MASK; va < end; va += PAGE_SIZE) {
			err = cs_miss(r, va, write);
			if (err)
				return err;
		}
		err = cs_flush(r, write);
		if (err)
			return err;
		for (va = start; va < end;) {
			unsigned int n = min_t(u64, end - va, PAGE_SIZE - (va & ~PAGE_MASK));

			err = cs_access(r, &o, va, n);
			if (err)
				return err;
			va += n;
		}
		off += win;
	}
	a->result = write ? 0 : o.hash;
	return 0;
}

/* GATHER: every address as it is (unaligned within its page, duplicates) goes to gmem. */
static int cs_gather(struct cs_run *r, struct gmem_csample_run *a)
{
	u32 __user *uout = u64_to_user_ptr(a->out);
	struct cs_op o = { .op = GMEM_CSAMPLE_GATHER };
	u64 *addrs, k;
	int err = 0;

	/* One copy of the list (at most CS_MAX_GATHER entries, checked by cs_shape_ok). */
	addrs = memdup_array_user(u64_to_user_ptr(a->addrs), a->count, sizeof(*addrs));
	if (IS_ERR(addrs))
		return PTR_ERR(addrs);
	for (k = 0; k < a->count; k++) {
		if (addrs[k] % 4) {
			err = -EINVAL;
			goto out;
		}
	}
	for (k = 0; k < a->count && !err; k++)
		err = cs_miss(r, addrs[k], false);
	if (!err)
		err = cs_flush(r, false);
	for (k = 0; k < a->count && !err; k++) {
		err = cs_checkpoint(r);
		if (!err)
			err = cs_access(r, &o, addrs[k], 4);
		if (!err && put_user(o.word, &uout[k]))
			err = -EFAULT;
	}
	if (!err)
		a->result = a->count;
out:
	kfree(addrs);
	return err;
}

static bool cs_shape_ok(const struct gmem_csample_run *a)
{
	if (a->argsz != sizeof(*a) || a->reserved)
		return false;
	switch (a->op) {
	case GMEM_CSAMPLE_FILL:
	case GMEM_CSAMPLE_CHECKSUM:
		/* The range must end below 2^64 (so every address computed is representable). */
		return a->len && !(a->len % 4) && !(a->addr % 4) && a->addr + a->len > a->addr &&
		       a->addr + a->len <= (u64)-PAGE_SIZE;
	case GMEM_CSAMPLE_GATHER:
		return a->count && a->count <= CS_MAX_GATHER;
	}
	return false;
}

static long cs_run_ioctl(struct cs_dev *d, void __user *uarg)
{
	struct gmem_csample_run a;
	struct cs_run *r;
	void *ctx;
	int err;

	if (copy_from_user(&a, uarg, sizeof(a)))
		return -EFAULT;
	if (!cs_shape_ok(&a))
		return -EINVAL;
	r = kzalloc(sizeof(*r), GFP_KERNEL);
	if (!r)
		return -ENOMEM;
	r->d = d;
	/* Killable: an unplug holds the gate through the whole evacuation. */
	err = down_read_killable(&d->gate);
	if (err) {
		kfree(r);
		return err;
	}
	if (READ_ONCE(d->dead)) {
		err = -ENODEV;
		goto out_gate;
	}
	r->space = gmem_space_get_current();
	if (IS_ERR(r->space)) {
		err = PTR_ERR(r->space);
		goto out_gate;
	}
	ctx = gmem_space_ctx(d->gdev, r->space);
	if (IS_ERR(ctx)) {
		err = PTR_ERR(ctx);
		goto out_space;
	}
	r->ctx = ctx;
	err = a.op == GMEM_CSAMPLE_GATHER ? cs_gather(r, &a) : cs_stream(r, &a);
	a.faults = r->faults;
	a.batches = r->batches;
out_space:
	gmem_space_put(r->space);
out_gate:
	up_read(&d->gate);
	kfree(r);
	if (!err && copy_to_user(uarg, &a, sizeof(a)))
		err = -EFAULT;
	return err;
}

static long cs_info_ioctl(struct cs_dev *d, void __user *uarg)
{
	struct gmem_csample_info i;

	if (copy_from_user(&i, uarg, sizeof(i)))
		return -EFAULT;
	if (i.argsz != sizeof(i))
		return -EINVAL;
	i.gmem_id = d->gmem_id;
	i.nr_frames = d->nr_frames;
	i.ptes = atomic64_read(&d->ptes);
	i.copies = atomic64_read(&d->copies);
	return copy_to_user(uarg, &i, sizeof(i)) ? -EFAULT : 0;
}

/* Hot-unplug: stop new kernels, wait for running ones, then let gmem save our pages. */
static int cs_unplug(struct cs_dev *d)
{
	int err = 0;

	WRITE_ONCE(d->dead, true);
	down_write(&d->gate);
	if (d->gdev) {
		gmem_dev_unregister(d->gdev);
		d->gdev = NULL;
		pr_info("%s: unplugged\n", d->name);
	} else {
		err = -ENODEV;
	}
	up_write(&d->gate);
	return err;
}

static long cs_ioctl(struct file *f, unsigned int cmd, unsigned long arg)
{
	struct cs_dev *d = container_of(f->private_data, struct cs_dev, misc);

	switch (cmd) {
	case GMEM_CSAMPLE_IOC_RUN:
		return cs_run_ioctl(d, (void __user *)arg);
	case GMEM_CSAMPLE_IOC_INFO:
		return cs_info_ioctl(d, (void __user *)arg);
	case GMEM_CSAMPLE_IOC_UNPLUG:
		return cs_unplug(d);
	}
	return -ENOTTY;
}

static const struct file_operations cs_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = cs_ioctl,
};

static void cs_remove(struct cs_dev *d)
{
	if (d->misc_registered)
		misc_deregister(&d->misc);
	cs_unplug(d);
	vfree(d->mem);
	kfree(d);
}

static int cs_add(int index, u64 nr_frames)
{
	struct gmem_dev_props props = {
		.size = sizeof(props),
		.abi_version = GMEM_DRIVER_ABI_VERSION,
		.nr_frames = nr_frames,
	};
	struct gmem_dev *g;
	struct cs_dev *d;

	d = kzalloc(sizeof(*d), GFP_KERNEL);
	if (!d)
		return -ENOMEM;
	d->index = index;
	snprintf(d->name, sizeof(d->name), "gmem_csample%d", index);
	d->nr_frames = nr_frames;
	mutex_init(&d->channel);
	init_rwsem(&d->gate);
	d->mem = vzalloc(nr_frames * PAGE_SIZE);
	if (!d->mem) {
		kfree(d);
		return -ENOMEM;
	}
	props.name = d->name;
	props.drv = d;
	g = gmem_dev_register(&cs_ops, &props);
	if (IS_ERR(g)) {
		vfree(d->mem);
		kfree(d);
		return PTR_ERR(g);
	}
	d->gdev = g;
	d->gmem_id = gmem_dev_id(g);
	cs_devs[index] = d;
	pr_info("%s: gmem device %d, %llu frames\n", d->name, d->gmem_id, nr_frames);
	return 0;
}

/* The node of a device: created once every device is registered (see cs_init). */
static int cs_add_node(struct cs_dev *d)
{
	int err;

	d->misc.minor = MISC_DYNAMIC_MINOR;
	d->misc.name = d->name;
	d->misc.fops = &cs_fops;
	err = misc_register(&d->misc);
	if (!err)
		d->misc_registered = true;
	return err;
}

static void cs_remove_all(void)
{
	int i;

	for (i = 0; i < CS_MAX_DEVICES; i++) {
		if (cs_devs[i])
			cs_remove(cs_devs[i]);
		cs_devs[i] = NULL;
	}
}

static int __init cs_init(void)
{
	unsigned int i;
	int err;

	if (!nr_devices || nr_devices > CS_MAX_DEVICES || mem_kib < 64 || mem_kib > 65536 || mem_kib % 4)
		return -EINVAL;
	/*
	 * Register every device with gmem first and create the nodes last, so that no file
	 * can be open on a node while a later step of init may still fail (a failed init
	 * frees the module whatever is open).
	 */
	for (i = 0; i < nr_devices; i++) {
		err = cs_add(i, mem_kib / 4);
		if (err)
			goto fail;
	}
	for (i = 0; i < nr_devices; i++) {
		err = cs_add_node(cs_devs[i]);
		if (err)
			goto fail;
	}
	return 0;
fail:
	cs_remove_all();
	return err;
}

static void __exit cs_exit(void)
{
	cs_remove_all();
}

module_init(cs_init);
module_exit(cs_exit);
MODULE_DESCRIPTION("GMEM sample device driver in C");
MODULE_AUTHOR("GMEM developers");
MODULE_LICENSE("GPL");
