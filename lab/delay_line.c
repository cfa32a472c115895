/* The lab's inter-datacenter link, in C: the same line as delay_line.py, for a small part of its CPU.
 *
 * The line shares the cores with the ranks it carries, and a real WAN costs them no CPU, so every cycle it
 * spends is the lab's distortion. This program does what delay_line.py does, packet for packet: read a packet
 * from one datacenter's TUN device, hold it for the one-way delay, write it to the TUN of the datacenter that
 * owns its destination 198.18.(i+1).x; one FIFO for all directions (the delay is constant, so packets leave in
 * the order they came); a queue past MAX_QUEUED_BYTES drops, as a router's buffer does; the rate is the
 * kernel's tbf on each TUN, not the line's business.
 *
 * Built by delay_line.build_native() with the machine's C compiler and run by meridian lab:
 *
 *     delay-line ONE_WAY_US OFFLOAD NETNS DEVICE [NETNS DEVICE ...]
 *
 * (datacenter i = the i-th pair; OFFLOAD 1 = checksum and TCP segmentation offload, each packet behind a
 * 10-byte virtio_net_hdr). On SIGTERM or SIGINT it prints {"forwarded": N, "dropped": M} and exits 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_DCS 64
#define VNET_HDR_BYTES 10
#define READ_BYTES (65536 + VNET_HDR_BYTES)
#define MAX_QUEUED_BYTES (256L << 20)
#define DRAIN_PER_WAKE 256 /* read at most this many per device before letting due packets out */
#define IDLE_WAIT_NS 200000000L

struct packet {
    struct packet *next;
    int64_t due_ns;
    int dst;
    size_t len;
    unsigned char data[];
};

static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void die(const char *what, const char *detail) {
    fprintf(stderr, "delay-line: %s %s: %s\n", what, detail, strerror(errno));
    exit(1);
}

/* Attach to the persistent TUN `device` in namespace `netns`; the fd keeps working back in our own. */
static int open_tun(const char *netns, const char *device, int offload) {
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (home < 0) die("open", "/proc/self/ns/net");
    char path[256];
    snprintf(path, sizeof path, "/run/netns/%s", netns);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die("open", path);
    if (setns(ns, CLONE_NEWNET) != 0) die("setns", path);
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) die("open", "/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0);
    strncpy(ifr.ifr_name, device, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) != 0) die("TUNSETIFF", device);
    /* the device keeps the offloads an earlier line set: without the header it must not be handed segments */
    unsigned long offloads = offload ? (TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) : 0;
    if (ioctl(fd, TUNSETOFFLOAD, offloads) != 0) die("TUNSETOFFLOAD", device);
    if (setns(home, CLONE_NEWNET) != 0) die("setns", "back home");
    close(ns);
    close(home);
    return fd;
}

/* The datacenter index of the destination 198.18.(i+1).x of the IPv4 packet at `p`, else -1. */
static int destination_index(const unsigned char *p, size_t len) {
    if (len < 20 || p[0] >> 4 != 4 || p[16] != 198 || p[17] != 18 || p[18] == 0) return -1;
    return p[18] - 1;
}

int main(int argc, char **argv) {
    if (argc < 5 || (argc - 3) % 2 != 0 || (argc - 3) / 2 > MAX_DCS) {
        fprintf(stderr, "usage: %s ONE_WAY_US OFFLOAD NETNS DEVICE [NETNS DEVICE ...]\n", argv[0]);
        return 2;
    }
    int64_t one_way_ns = (int64_t)(atof(argv[1]) * 1000.0);
    int offload = atoi(argv[2]);
    size_t at = offload ? VNET_HDR_BYTES : 0;
    int n = (argc - 3) / 2;
    struct pollfd fds[MAX_DCS];
    for (int i = 0; i < n; i++) {
        fds[i].fd = open_tun(argv[3 + 2 * i], argv[4 + 2 * i], offload);
        fds[i].events = POLLIN;
    }

    /* SIGTERM is blocked except inside ppoll, so a stop cannot slip in between the check and the wait. */
    sigset_t blocked, during_wait;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigprocmask(SIG_BLOCK, &blocked, &during_wait);
    sigdelset(&during_wait, SIGTERM);
    sigdelset(&during_wait, SIGINT);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    static unsigned char buf[READ_BYTES];
    struct packet *head = NULL, *tail = NULL;
    long queued = 0;
    unsigned long forwarded = 0, dropped = 0;
    while (!stop) {
        int64_t now = now_ns();
        int64_t wait = head ? head->due_ns - now : IDLE_WAIT_NS;
        if (wait < 0) wait = 0;
        struct timespec timeout = {wait / 1000000000L, wait % 1000000000L};
        int ready = ppoll(fds, n, &timeout, &during_wait);
        if (ready < 0) {
            if (errno == EINTR) continue;
            die("ppoll", "");
        }
        now = now_ns();
        for (int i = 0; ready > 0 && i < n; i++) {
            if (!(fds[i].revents & POLLIN)) continue;
            for (int k = 0; k < DRAIN_PER_WAKE; k++) {
                ssize_t len = read(fds[i].fd, buf, sizeof buf);
                if (len < 0) {
                    if (errno == EAGAIN || errno == EINTR) break;
                    die("read", argv[4 + 2 * i]);
                }
                int dst = len > (ssize_t)at ? destination_index(buf + at, (size_t)len - at) : -1;
                if (dst < 0 || dst >= n || dst == i || queued > MAX_QUEUED_BYTES) {
                    dropped++;
                    continue;
                }
                struct packet *p = malloc(sizeof *p + (size_t)len);
                if (!p) die("malloc", "");
                p->next = NULL;
                p->due_ns = now + one_way_ns;
                p->dst = dst;
                p->len = (size_t)len;
                memcpy(p->data, buf, (size_t)len);
                if (tail) tail->next = p; else head = p;
                tail = p;
                queued += len;
            }
        }
        now = now_ns();
        while (head && head->due_ns <= now) {
            struct packet *p = head;
            head = p->next;
            if (!head) tail = NULL;
            queued -= (long)p->len;
            if (write(fds[p->dst].fd, p->data, p->len) < 0) {
                /* the receiving namespace is going away, or its queue is full */
                if (errno != EAGAIN && errno != EIO && errno != EBADFD) die("write", argv[4 + 2 * p->dst]);
                dropped++;
            } else {
                forwarded++;
            }
            free(p);
        }
    }
    printf("{\"forwarded\": %lu, \"dropped\": %lu}\n", forwarded, dropped);
    return 0;
}
