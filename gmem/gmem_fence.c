// SPDX-License-Identifier: GPL-2.0
/*
 * gmem_fence.c - a fence's sleep with a deadline (obj/fence.rs).
 *
 * A waiter whose driver said when a copy is expected to complete sleeps until shortly
 * before then and polls the copy's channel from then on. The completion API has timeouts
 * in jiffies only (4 ms at HZ=250, longer than most copies), so this sleeps on the
 * completion's wait queue with a CLOCK_MONOTONIC hrtimer of its own, as
 * do_wait_for_common() does with a jiffies timer.
 */

#include <linux/completion.h>
#include <linux/hrtimer.h>
#include <linux/sched.h>
#include <linux/swait.h>

bool gmem_completion_wait_until(struct completion *x, u64 until_ns);

/*
 * Sleeps (uninterruptibly) until @x is completed or the CLOCK_MONOTONIC time @until_ns
 * has come, whichever is first; true if @x is completed. Does not consume the
 * completion: the caller still waits for it with wait_for_completion(), which then
 * returns at once. Process context.
 */
bool gmem_completion_wait_until(struct completion *x, u64 until_ns)
{
	struct hrtimer_sleeper t;
	DECLARE_SWAITQUEUE(w);
	bool done;

	hrtimer_setup_sleeper_on_stack(&t, CLOCK_MONOTONIC, HRTIMER_MODE_ABS);
	hrtimer_set_expires(&t.timer, ns_to_ktime(until_ns));
	hrtimer_sleeper_start_expires(&t, HRTIMER_MODE_ABS);
	for (;;) {
		/* On the queue before the test, so that a complete() after it wakes us. */
		prepare_to_swait_exclusive(&x->wait, &w, TASK_UNINTERRUPTIBLE);
		done = completion_done(x);
		/* The sleeper's callback clears t.task when the deadline has come. */
		if (done || !READ_ONCE(t.task))
			break;
		schedule();
	}
	finish_swait(&x->wait, &w);
	hrtimer_cancel(&t.timer);
	destroy_hrtimer_on_stack(&t.timer);
	return done;
}
