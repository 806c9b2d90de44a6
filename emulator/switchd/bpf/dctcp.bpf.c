// SPDX-License-Identifier: GPL-2.0
/*
 * DCTCP (RFC 8257) as a BPF TCP congestion control, "closbox_dctcp": what a fabric's GPUs
 * run for `[nic] tcp_congestion = "dctcp"` on a kernel built without tcp_dctcp (this
 * box's). Written for closbox from the RFC.
 *
 * Sender: F, the fraction of the packets acknowledged over a window of data whose ACKs
 * echoed a congestion mark; alpha <- (1 - g) alpha + g F with g = 1/16; a window that
 * saw an echo cuts the congestion window to cwnd (1 - alpha / 2), not Reno's cwnd / 2.
 * Growth, and the answer to a loss, are Reno's (the kernel's `tcp_reno_cong_avoid`).
 * Receiver: its ECN echo says which packets were marked, not only that one was: when the
 * arriving packets' CE state changes, an ACK a delayed ACK was holding back leaves first
 * with the old state, and the packet that changed it is acknowledged at once (RFC 8257
 * section 3.2).
 *
 * Compiled by emulator/switchd/build.rs (clang -target bpf) with no kernel headers: the
 * kernel structures below hold only the fields used, and libbpf finds each one in the
 * running kernel's BTF when it loads the program (CO-RE), so the object is not tied to the
 * kernel it was built on. Loaded and registered by the switch daemon for its fabric's life
 * (emulator/switchd/src/bpf.rs). GPL: the kernel lets only GPL programs call
 * bpf_tcp_send_ack and the TCP kfuncs.
 */

typedef unsigned char __u8;
typedef unsigned int __u32;
typedef int __s32;
typedef unsigned long long __u64;

#define SEC(name) __attribute__((section(name), used))
#define KERNEL __attribute__((preserve_access_index))

/* Constants of include/net/tcp.h and inet_connection_sock.h (not in BTF as such). */
#define CONG_NON_RESTRICTED 0x1 /* a network namespace may make it its default */
#define CONG_NEEDS_ECN 0x2      /* negotiate ECN whatever net.ipv4.tcp_ecn says */
#define ECN_DEMAND_CWR 0x4      /* tcp_sock.ecn_flags: set ECE on what it sends */
#define CA_EVENT_LOSS 3
#define CA_EVENT_ECN_NO_CE 4
#define CA_EVENT_ECN_IS_CE 5
#define CA_RECOVERY 3       /* TCP_CA_Recovery */
#define ICSK_ACK_TIMER 2
#define ICSK_ACK_NOW 16
#define HELPER_TCP_SEND_ACK 116 /* BPF_FUNC_tcp_send_ack */

#define ALPHA_ONE 1024U /* alpha is kept in 1/1024ths */
#define G_SHIFT 4       /* g = 1/16 */

struct sock {
} KERNEL;

struct inet_connection_sock {
	struct {
		__u8 pending;
	} icsk_ack;
	__u64 icsk_ca_priv[13];
} KERNEL;

struct tcp_sock {
	__u32 rcv_nxt;
	__u32 snd_nxt;
	__u32 snd_una;
	__u32 snd_cwnd;
	__u32 snd_ssthresh;
	__u32 delivered;
	__u32 delivered_ce;
	__u8 ecn_flags;
} KERNEL;

struct tcp_congestion_ops {
	__u32 (*ssthresh)(struct sock *sk);
	void (*cong_avoid)(struct sock *sk, __u32 ack, __u32 acked);
	void (*set_state)(struct sock *sk, __u8 new_state);
	void (*cwnd_event)(struct sock *sk, int ev);
	void (*in_ack_event)(struct sock *sk, __u32 flags);
	__u32 (*undo_cwnd)(struct sock *sk);
	void (*init)(struct sock *sk);
	__u32 flags;
	char name[16];
};

extern void tcp_reno_cong_avoid(struct sock *sk, __u32 ack, __u32 acked) SEC(".ksyms");
static long (*bpf_tcp_send_ack)(void *tp, __u32 rcv_nxt) = (void *)HELPER_TCP_SEND_ACK;

char LICENSE[] SEC("license") = "GPL";

/* Per connection, in the kernel's icsk_ca_priv (104 bytes). */
struct cb_dctcp {
	__u32 alpha;        /* in 1/1024ths */
	__u32 window_end;   /* snd_nxt when the current window of data began */
	__u32 delivered;    /* tp->delivered then */
	__u32 delivered_ce; /* tp->delivered_ce then */
	__u32 loss_cwnd;    /* cwnd before the last cut, for undo */
	__u32 ca_state;     /* the last state set_state was told */
	__u32 ce;           /* receiver: whether the last packet carried CE */
	__u32 acked_until;  /* receiver: rcv_nxt when the CE state last changed */
};

static __attribute__((always_inline)) struct cb_dctcp *state(struct sock *sk)
{
	return (struct cb_dctcp *)((struct inet_connection_sock *)sk)->icsk_ca_priv;
}

static __attribute__((always_inline)) void new_window(struct tcp_sock *tp, struct cb_dctcp *s)
{
	s->window_end = tp->snd_nxt;
	s->delivered = tp->delivered;
	s->delivered_ce = tp->delivered_ce;
}

/* Each program takes the kernel's arguments as an array of 64-bit words. */

SEC("struct_ops/cb_dctcp_init")
void cb_dctcp_init(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	struct cb_dctcp *s = state(sk);

	/* RFC 8257 section 3.3: start as if every packet had been marked, so that the
	 * first marks cut as Reno's would, and alpha decays from there. */
	s->alpha = ALPHA_ONE;
	s->loss_cwnd = 0;
	s->ca_state = 0;
	s->ce = 0;
	s->acked_until = tp->rcv_nxt;
	new_window(tp, s);
}

SEC("struct_ops/cb_dctcp_ssthresh")
__u32 cb_dctcp_ssthresh(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	struct cb_dctcp *s = state(sk);
	__u32 cwnd = tp->snd_cwnd;
	__u32 cut = (__u32)(((__u64)cwnd * s->alpha) >> 11); /* cwnd alpha / 2 */

	s->loss_cwnd = cwnd;
	return cwnd - cut > 2 ? cwnd - cut : 2;
}

SEC("struct_ops/cb_dctcp_in_ack_event")
void cb_dctcp_in_ack_event(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	struct cb_dctcp *s = state(sk);
	__u32 alpha, acked, marked, decay;

	if ((__s32)(tp->snd_una - s->window_end) < 0)
		return;
	/* A window of data is acknowledged: alpha <- alpha - g alpha + g F. The decay is
	 * at least 1 so that alpha reaches 0 after a long run without marks. */
	alpha = s->alpha;
	decay = alpha >> G_SHIFT;
	alpha -= decay ? decay : (alpha ? 1 : 0);
	marked = tp->delivered_ce - s->delivered_ce;
	acked = tp->delivered - s->delivered;
	if (marked) {
		alpha += (__u32)(((__u64)marked << (10 - G_SHIFT)) / (acked ? acked : 1));
		if (alpha > ALPHA_ONE)
			alpha = ALPHA_ONE;
	}
	s->alpha = alpha;
	new_window(tp, s);
}

static __attribute__((always_inline)) void on_loss(struct sock *sk)
{
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	__u32 half = tp->snd_cwnd >> 1;

	/* A loss is answered as Reno answers it (RFC 8257 section 3.5). */
	state(sk)->loss_cwnd = tp->snd_cwnd;
	tp->snd_ssthresh = half > 2 ? half : 2;
}

SEC("struct_ops/cb_dctcp_set_state")
void cb_dctcp_set_state(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	__u8 new_state = (__u8)ctx[1];
	struct cb_dctcp *s = state(sk);

	/* Every change of the congestion state comes through here before it is made:
	 * entering fast recovery is a loss (a timeout comes as CA_EVENT_LOSS). */
	if (new_state == CA_RECOVERY && s->ca_state != CA_RECOVERY)
		on_loss(sk);
	s->ca_state = new_state;
}

static __attribute__((always_inline)) void echo(struct tcp_sock *tp, __u32 ce)
{
	if (ce)
		tp->ecn_flags |= ECN_DEMAND_CWR;
	else
		tp->ecn_flags &= ~ECN_DEMAND_CWR;
}

SEC("struct_ops/cb_dctcp_cwnd_event")
void cb_dctcp_cwnd_event(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	int ev = (int)ctx[1];
	struct inet_connection_sock *icsk = (struct inet_connection_sock *)sk;
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	struct cb_dctcp *s = state(sk);
	__u32 ce;

	if (ev == CA_EVENT_LOSS) {
		on_loss(sk);
		return;
	}
	if (ev != CA_EVENT_ECN_IS_CE && ev != CA_EVENT_ECN_NO_CE)
		return;
	ce = ev == CA_EVENT_ECN_IS_CE;
	if (s->ce != ce) {
		/* What a delayed ACK holds back arrived in the old state: it leaves first,
		 * saying so; the packet that changed the state is acknowledged at once. */
		if (icsk->icsk_ack.pending & ICSK_ACK_TIMER) {
			echo(tp, s->ce);
			bpf_tcp_send_ack(tp, s->acked_until);
		}
		icsk->icsk_ack.pending |= ICSK_ACK_NOW;
	}
	s->acked_until = tp->rcv_nxt;
	s->ce = ce;
	echo(tp, ce);
}

SEC("struct_ops/cb_dctcp_cong_avoid")
void cb_dctcp_cong_avoid(__u64 *ctx)
{
	tcp_reno_cong_avoid((struct sock *)ctx[0], (__u32)ctx[1], (__u32)ctx[2]);
}

SEC("struct_ops/cb_dctcp_undo_cwnd")
__u32 cb_dctcp_undo_cwnd(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	__u32 before = state(sk)->loss_cwnd;

	return tp->snd_cwnd > before ? tp->snd_cwnd : before;
}

SEC(".struct_ops")
struct tcp_congestion_ops cb_dctcp = {
	.init = (void *)cb_dctcp_init,
	.ssthresh = (void *)cb_dctcp_ssthresh,
	.in_ack_event = (void *)cb_dctcp_in_ack_event,
	.set_state = (void *)cb_dctcp_set_state,
	.cwnd_event = (void *)cb_dctcp_cwnd_event,
	.cong_avoid = (void *)cb_dctcp_cong_avoid,
	.undo_cwnd = (void *)cb_dctcp_undo_cwnd,
	.flags = CONG_NON_RESTRICTED | CONG_NEEDS_ECN,
	.name = "closbox_dctcp",
};
