/* A delay line: every IP packet routed into a TUN device comes back out of it `delay` later, in order.

   delay_line TUN_NAME DELAY_US [SLOTS]

   Creates the TUN device TUN_NAME (no packet information header), prints "ready" on stdout once it exists, then
   reads each packet the kernel routes into it, stamps it with the time it was read (CLOCK_MONOTONIC) and writes it
   back into the device DELAY_US microseconds later: the kernel takes it as received on TUN_NAME and routes it on.
   Every packet waits the same time, so the queue is a FIFO ring of SLOTS packets (default 65536); a packet that
   finds the ring full is dropped and counted. It runs at real-time priority (SCHED_FIFO) when it may, so that the
   delay holds while other processes load every core, and ends on SIGTERM, SIGINT or its parent's death, printing
   on stderr the packets it carried, those it dropped, and how late it wrote them (median, 99th percentile, max).
   Used by `benchmarks.real_link` (Network) in a router namespace between the stage namespaces. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define PACKET_BYTES 2048 /* > the MTU of 1500: the kernel segments before the TUN device (no offloads on it) */
#define LATE_BUCKETS 100000 /* a histogram of lateness in microseconds, the last bucket open-ended */

typedef struct {
  int64_t due_ns;
  int32_t length;
  unsigned char data[PACKET_BYTES];
} Packet;

static volatile sig_atomic_t stopping = 0;
static void stop(int signum) { (void)signum; stopping = 1; }

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t percentile(const uint64_t *histogram, uint64_t count, double share) {
  uint64_t seen = 0, wanted = (uint64_t)(share * (double)count);
  for (int64_t us = 0; us < LATE_BUCKETS; us++) {
    seen += histogram[us];
    if (seen > wanted) return us;
  }
  return LATE_BUCKETS;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s TUN_NAME DELAY_US [SLOTS]\n", argv[0]);
    return 2;
  }
  const int64_t delay_ns = strtoll(argv[2], NULL, 10) * 1000;
  const long slots = argc > 3 ? strtol(argv[3], NULL, 10) : 65536;
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  signal(SIGTERM, stop);
  signal(SIGINT, stop);
  struct sched_param priority = {.sched_priority = 10};
  int realtime = sched_setscheduler(0, SCHED_FIFO, &priority) == 0;

  int tun = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (tun < 0) {
    perror("open /dev/net/tun");
    return 1;
  }
  struct ifreq request;
  memset(&request, 0, sizeof request);
  request.ifr_flags = IFF_TUN | IFF_NO_PI;
  strncpy(request.ifr_name, argv[1], IFNAMSIZ - 1);
  if (ioctl(tun, TUNSETIFF, &request) < 0) {
    perror("TUNSETIFF");
    return 1;
  }
  Packet *ring = calloc((size_t)slots, sizeof(Packet));
  uint64_t *late = calloc(LATE_BUCKETS + 1, sizeof(uint64_t));
  if (!ring || !late) {
    fprintf(stderr, "out of memory for %ld slots\n", slots);
    return 1;
  }
  printf("ready\n");
  fflush(stdout);

  static unsigned char discard[PACKET_BYTES];
  long head = 0, size = 0;
  uint64_t carried = 0, dropped = 0, failed = 0;
  int64_t late_max_ns = 0;
  while (!stopping) {
    int64_t now = now_ns();
    while (size > 0 && ring[head].due_ns <= now) { /* write back every packet that is due */
      Packet *p = &ring[head];
      if (write(tun, p->data, (size_t)p->length) == p->length) {
        int64_t behind = now - p->due_ns;
        late_max_ns = behind > late_max_ns ? behind : late_max_ns;
        late[behind / 1000 < LATE_BUCKETS ? behind / 1000 : LATE_BUCKETS]++;
        carried++;
      } else {
        failed++;
      }
      head = (head + 1) % slots;
      size--;
      now = now_ns();
    }
    struct pollfd readable = {.fd = tun, .events = POLLIN};
    struct timespec wait = {.tv_sec = 0, .tv_nsec = 100000000}; /* wake at least every 100 ms to see a signal */
    if (size > 0) {
      int64_t until = ring[head].due_ns - now;
      wait.tv_sec = until / 1000000000;
      wait.tv_nsec = until % 1000000000;
    }
    if (ppoll(&readable, 1, &wait, NULL) < 0 && errno != EINTR) {
      perror("ppoll");
      return 1;
    }
    if (!(readable.revents & POLLIN)) continue;
    for (;;) { /* read every packet waiting, each stamped with its own arrival */
      Packet *p = &ring[(head + size) % slots];
      ssize_t n = read(tun, size < slots ? p->data : discard, PACKET_BYTES);
      if (n < 0) break; /* EAGAIN: nothing more */
      if (size == slots) { /* the ring is full: this packet is lost */
        dropped++;
        continue;
      }
      p->length = (int32_t)n;
      p->due_ns = now_ns() + delay_ns;
      size++;
    }
  }
  uint64_t count = carried ? carried : 1;
  fprintf(stderr, "delay_line %s: delay %.3f ms, %s priority, carried %llu packets, dropped %llu (ring full) + %llu "
          "(write failed), written late by median %lld us, p99 %lld us, max %.3f ms\n",
          argv[1], delay_ns / 1e6, realtime ? "real-time" : "normal", (unsigned long long)carried,
          (unsigned long long)dropped, (unsigned long long)failed, (long long)percentile(late, count, 0.5),
          (long long)percentile(late, count, 0.99), late_max_ns / 1e6);
  return 0;
}
