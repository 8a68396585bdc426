// SPDX-License-Identifier: GPL-2.0
/*
 * /sys/class/gmem/gmemN: the stable per-device facts and knobs of gmem.ko
 * (Documentation/ABI/testing/sysfs-class-gmem). Debugging detail stays in debugfs.
 *
 * The values come from the Rust core (gmem/entry/sysfs.rs) through gmem_sysfs_get() and
 * gmem_sysfs_set(), by attribute index; this file only does the sysfs plumbing, for which
 * the 7.3 Rust tree has no abstraction. The index order below is the one entry/sysfs.rs
 * matches on (the guest test sysfs_matches_debugfs reads every attribute and compares).
 *
 * Lifetimes: gmem_dev_register() adds a device's node once the device is in the table,
 * and gmem_dev_unregister() removes it before the id can be reused. device_unregister()
 * drains running show/store calls (kernfs active references), so no attribute call runs
 * for an id after its node is gone; the Rust side looks the device up by id under RCU, so
 * a call racing with unregistration finds it or gets -ENODEV. The class is registered at
 * module init and unregistered at exit, after every device is gone (drivers pin gmem.ko).
 * gmem_sysfs_lock serialises add and remove (they run in register/unregister only).
 */
#include <linux/device.h>
#include <linux/kdev_t.h>
#include <linux/kstrtox.h>
#include <linux/mutex.h>
#include <linux/sysfs.h>

#define GMEM_SYSFS_MAX_DEVICES	16	/* MAX_DEVICES of the core */

enum gmem_sysfs_attr {
	GMEM_SA_FRAMES, GMEM_SA_USED, GMEM_SA_PINNED, GMEM_SA_LENT, GMEM_SA_ALIVE,
	GMEM_SA_WATERMARK_LOW, GMEM_SA_WATERMARK_HIGH,
	/* stats/ */
	GMEM_SA_FAULT_BATCHES, GMEM_SA_FAULTS, GMEM_SA_PAGES_H2D, GMEM_SA_PAGES_D2H,
	GMEM_SA_PAGES_D2D, GMEM_SA_PAGES_ZEROED, GMEM_SA_PREFETCHED, GMEM_SA_EVICTED_TO_HOST,
	GMEM_SA_EVICTED_TO_PEER, GMEM_SA_EVICTED_CLEAN, GMEM_SA_PRE_EVICTED, GMEM_SA_WRITEBACKS,
	GMEM_SA_EVACUATED, GMEM_SA_LOST, GMEM_SA_THRASH_EVENTS,
};

/* Implemented in Rust (gmem/entry/sysfs.rs): 0 or a negative errno. */
int gmem_sysfs_get(int id, unsigned int attr, u64 *val);
int gmem_sysfs_set(int id, unsigned int attr, u64 val);

struct gmem_attr {
	struct device_attribute dattr;
	unsigned int idx;
};

/* A node's device id, stored as id + 1 (drvdata 0 would mean none). */
static int gmem_sysfs_id(struct device *dev)
{
	return (int)(uintptr_t)dev_get_drvdata(dev) - 1;
}

static ssize_t gmem_attr_show(struct device *dev, struct device_attribute *a, char *buf)
{
	struct gmem_attr *ga = container_of(a, struct gmem_attr, dattr);
	u64 v;
	int err = gmem_sysfs_get(gmem_sysfs_id(dev), ga->idx, &v);

	return err ? err : sysfs_emit(buf, "%llu\n", v);
}

static ssize_t gmem_attr_store(struct device *dev, struct device_attribute *a, const char *buf, size_t len)
{
	struct gmem_attr *ga = container_of(a, struct gmem_attr, dattr);
	u64 v;
	int err = kstrtou64(buf, 0, &v);

	if (!err)
		err = gmem_sysfs_set(gmem_sysfs_id(dev), ga->idx, v);
	return err ? err : len;
}

#define GMEM_RO(_name, _idx) \
	static struct gmem_attr gmem_attr_##_name = { \
		.dattr = __ATTR(_name, 0444, gmem_attr_show, NULL), .idx = _idx }
#define GMEM_RW(_name, _idx) \
	static struct gmem_attr gmem_attr_##_name = { \
		.dattr = __ATTR(_name, 0644, gmem_attr_show, gmem_attr_store), .idx = _idx }

GMEM_RO(frames, GMEM_SA_FRAMES);
GMEM_RO(used, GMEM_SA_USED);
GMEM_RO(pinned, GMEM_SA_PINNED);
GMEM_RO(lent, GMEM_SA_LENT);
GMEM_RO(alive, GMEM_SA_ALIVE);
GMEM_RW(watermark_low, GMEM_SA_WATERMARK_LOW);
GMEM_RW(watermark_high, GMEM_SA_WATERMARK_HIGH);
GMEM_RO(fault_batches, GMEM_SA_FAULT_BATCHES);
GMEM_RO(faults, GMEM_SA_FAULTS);
GMEM_RO(pages_h2d, GMEM_SA_PAGES_H2D);
GMEM_RO(pages_d2h, GMEM_SA_PAGES_D2H);
GMEM_RO(pages_d2d, GMEM_SA_PAGES_D2D);
GMEM_RO(pages_zeroed, GMEM_SA_PAGES_ZEROED);
GMEM_RO(prefetched, GMEM_SA_PREFETCHED);
GMEM_RO(evicted_to_host, GMEM_SA_EVICTED_TO_HOST);
GMEM_RO(evicted_to_peer, GMEM_SA_EVICTED_TO_PEER);
GMEM_RO(evicted_clean, GMEM_SA_EVICTED_CLEAN);
GMEM_RO(pre_evicted, GMEM_SA_PRE_EVICTED);
GMEM_RO(writebacks, GMEM_SA_WRITEBACKS);
GMEM_RO(evacuated, GMEM_SA_EVACUATED);
GMEM_RO(lost, GMEM_SA_LOST);
GMEM_RO(thrash_events, GMEM_SA_THRASH_EVENTS);

static struct attribute *gmem_dev_attrs[] = {
	&gmem_attr_frames.dattr.attr, &gmem_attr_used.dattr.attr, &gmem_attr_pinned.dattr.attr,
	&gmem_attr_lent.dattr.attr, &gmem_attr_alive.dattr.attr,
	&gmem_attr_watermark_low.dattr.attr, &gmem_attr_watermark_high.dattr.attr,
	NULL,
};

static struct attribute *gmem_stats_attrs[] = {
	&gmem_attr_fault_batches.dattr.attr, &gmem_attr_faults.dattr.attr,
	&gmem_attr_pages_h2d.dattr.attr, &gmem_attr_pages_d2h.dattr.attr,
	&gmem_attr_pages_d2d.dattr.attr, &gmem_attr_pages_zeroed.dattr.attr,
	&gmem_attr_prefetched.dattr.attr, &gmem_attr_evicted_to_host.dattr.attr,
	&gmem_attr_evicted_to_peer.dattr.attr, &gmem_attr_evicted_clean.dattr.attr,
	&gmem_attr_pre_evicted.dattr.attr, &gmem_attr_writebacks.dattr.attr,
	&gmem_attr_evacuated.dattr.attr, &gmem_attr_lost.dattr.attr,
	&gmem_attr_thrash_events.dattr.attr,
	NULL,
};

static const struct attribute_group gmem_dev_group = { .attrs = gmem_dev_attrs };
static const struct attribute_group gmem_stats_group = { .name = "stats", .attrs = gmem_stats_attrs };
static const struct attribute_group *gmem_dev_groups[] = { &gmem_dev_group, &gmem_stats_group, NULL };

static const struct class gmem_class = { .name = "gmem" };
static struct device *gmem_sysfs_devs[GMEM_SYSFS_MAX_DEVICES];
static DEFINE_MUTEX(gmem_sysfs_lock);

int gmem_sysfs_init(void);
int gmem_sysfs_init(void)
{
	return class_register(&gmem_class);
}

void gmem_sysfs_exit(void);
void gmem_sysfs_exit(void)
{
	class_unregister(&gmem_class);
}

/* Adds /sys/class/gmem/gmem@id; 0 or a negative errno. */
int gmem_sysfs_add(int id);
int gmem_sysfs_add(int id)
{
	struct device *dev;
	int err = 0;

	if (id < 0 || id >= GMEM_SYSFS_MAX_DEVICES)
		return -EINVAL;
	mutex_lock(&gmem_sysfs_lock);
	if (gmem_sysfs_devs[id]) {
		err = -EEXIST;
		goto out;
	}
	dev = device_create_with_groups(&gmem_class, NULL, MKDEV(0, 0), (void *)(uintptr_t)(id + 1),
					gmem_dev_groups, "gmem%d", id);
	if (IS_ERR(dev))
		err = PTR_ERR(dev);
	else
		gmem_sysfs_devs[id] = dev;
out:
	mutex_unlock(&gmem_sysfs_lock);
	return err;
}

/* Removes the node of @id, if any; returns once no attribute call of it is running. */
void gmem_sysfs_remove(int id);
void gmem_sysfs_remove(int id)
{
	struct device *dev;

	if (id < 0 || id >= GMEM_SYSFS_MAX_DEVICES)
		return;
	mutex_lock(&gmem_sysfs_lock);
	dev = gmem_sysfs_devs[id];
	gmem_sysfs_devs[id] = NULL;
	mutex_unlock(&gmem_sysfs_lock);
	if (dev)
		device_unregister(dev);
}
